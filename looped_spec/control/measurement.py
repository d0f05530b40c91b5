"""Which rounds take counterfactual depth readouts: as often as a small time budget allows.

The goodput policy learns acceptance from counterfactual readouts (every shallower depth read out on the
committed positions, docs/adaptive.md "acceptance model"). What a measured round costs extra is a property of
the model and the batch: on this project's CPU, measuring every plain round cost 3 % of tiny-ouro's decode
time at B = 1 when timed end to end, 4–5 % of tiny-nanbeige's and 20–40 % of tiny-huginn's (its readout runs
the coda layers). A fixed interval is wrong for one of them either way: every 32nd plain round wastes nothing
on Huginn but gives a single Ouro stream 2 readouts per 64-token generation.

`MeasureSchedule` estimates, per kind of round (plain, speculative), the extra cost fraction f of a measured
round and measures every ceil(f / budget)-th round of that kind (median f of the last `WINDOW` estimates; the
interval clamped to [min_every, max_every]). An estimate compares a measured round's seconds with the median
of the last unmeasured rounds of the same shape — same batch size, same (K, d) — so timings of different
batch sizes or plans are never compared; the median keeps one stalled round from moving it. Timing only the
readouts themselves (`RoundFeedback.measure_time`) undercounts: on tiny-ouro at B = 1 they were a third of
the measured rounds' extra time, the rest being the comparisons and bookkeeping around them. That timing is
the fallback, a lower bound, while a shape has no unmeasured rounds to compare with yet. Until the first
estimate every `initial_every`-th round measures.

Gaps are jittered: after a measured round the next gap is drawn uniformly from every·[0.5, 1.5) (mean
`every`; seeded, so a run is reproducible). A fixed gap samples fixed positions of a generation: a prompt
decoded again (a benchmark's repeats; a client retrying) is read out at the same few positions every time,
and acceptance learned from them stays as far off as those positions happen to be — on tiny-ouro's first
evaluation prompt 0.68 after 8 generations against the text's 0.75.

While the policy's acceptance estimate is young (`due(..., young=True)`: its first rounds, when its prior —
the tuning text's acceptance — still weighs), the budget is `young_budget` (5 %) where a measured round costs
at most `young_max_fraction` (10 %) extra: a wrong early plan costs more than such readouts. On tiny-ouro at
B = 1 that is every round (α₁ within 0.03 of the text's after one 64-token generation instead of eight).
Where readouts are dear (tiny-huginn, 20–40 % of a round) the interval stays the budget's: every 6th round
at 5 % would cost more than the few points of α it gains there. The policy bounds the young phase
(goodput: 64 rounds), so its extra cost is bounded too.

Where nothing is near a switch (`due(..., far=True)`: the goodput policy runs plain decoding and predicts every
speculative option under it, `GoodputPolicy.readouts_far`) a readout can only show that acceptance moved, and the
budget is `far_budget` (0.25 %). On the random-weight fixture, where speculation never pays, readouts at the 1 %
budget were most of what the adaptive engine cost over plain decoding: measured plain
rounds cost 12 % (B = 1) and 6 % (B = 8) extra and ran every 6-8 rounds, and the engine measured 0.977x and
0.976x plain, against 1.007x and 0.987x with readouts off (docs/benchmarking.md's interleaved timing, 40
rounds). As estimates move an option over plain, the 1 % budget applies again at once. (Until 2026-12-02 the far
budget needed every option 10 % under plain; readouts at 1 % cost an engine running plain 1.3-2 % where the
options sat 0-10 % under plain: `goodput.READOUTS_FAR_FROM`.)
"""

from __future__ import annotations

import math
import random
import statistics
from collections import deque

#: Share of decode time the measured rounds may cost extra (1 %).
MEASURE_BUDGET = 0.01
#: Share of decode time measured rounds may cost extra while the policy's acceptance estimate is young (5 %),
#: where a measured round costs at most YOUNG_MAX_FRACTION extra (10 %).
YOUNG_BUDGET = 0.05
YOUNG_MAX_FRACTION = 0.10
#: Share of decode time measured rounds may cost extra where no plan is near a switch (0.25 %).
FAR_BUDGET = 0.0025
#: Cost-fraction estimates kept per kind of round.
WINDOW = 8
#: Unmeasured rounds per shape whose median a measured round is compared with (at least BASELINE_MIN of them).
BASELINE = 16
BASELINE_MIN = 4

Shape = tuple[int, int, int]  # (batch size, K, d); K = d = 0 for plain rounds


class MeasureSchedule:
    """Decides per planned round whether it takes counterfactual readouts (see the module docstring).

    `every`: a fixed interval for both kinds instead (e.g. 1: every round, as some tests want).
    """

    def __init__(
        self,
        budget: float = MEASURE_BUDGET,
        min_every: int = 4,
        max_every: int = 64,
        initial_every: int = 8,
        every: int | None = None,
        young_budget: float = YOUNG_BUDGET,
        young_max_fraction: float = YOUNG_MAX_FRACTION,
        far_budget: float = FAR_BUDGET,
        seed: int = 0,
    ) -> None:
        if budget <= 0.0 or young_budget < budget or not 0.0 < far_budget <= budget:
            raise ValueError("need budget > 0, young_budget >= budget and 0 < far_budget <= budget")
        if not 1 <= min_every <= initial_every <= max_every or (every is not None and every < 1):
            raise ValueError("need 1 <= min_every <= initial_every <= max_every and every >= 1")
        self.budget, self.young_budget, self.young_max_fraction = budget, young_budget, young_max_fraction
        self.far_budget = far_budget
        self.min_every, self.max_every, self.initial_every = min_every, max_every, initial_every
        self.fixed = every
        self.fractions: dict[bool, deque[float]] = {False: deque(maxlen=WINDOW), True: deque(maxlen=WINDOW)}
        self.since: dict[bool, int | None] = {False: None, True: None}  # rounds since the last measured one
        self.unmeasured: dict[Shape, deque[float]] = {}  # seconds of recent unmeasured rounds per shape
        self._every = {False: initial_every, True: initial_every}  # from `fractions`, updated as they come
        self._young_every = {False: 1, True: 1}  # the same at `young_budget` (floor 1) where readouts are cheap
        self._far_every = {False: initial_every, True: initial_every}  # the same at `far_budget`
        self._rng = random.Random(seed)
        self._jitter = {False: 0.0, True: 0.0}  # uniform draw of the current gap, in [0, 1)

    def every(self, speculative: bool, young: bool = False, far: bool = False) -> int:
        """Current mean interval for this kind of round (1 = every round); `young` wins over `far`."""
        if self.fixed is not None:
            return self.fixed
        if young:
            return self._young_every[speculative]
        return self._far_every[speculative] if far else self._every[speculative]

    def _update(self, speculative: bool) -> None:
        fraction = statistics.median(self.fractions[speculative])
        wanted = math.ceil(fraction / self.budget - 1e-9)
        self._every[speculative] = every = min(max(wanted, self.min_every), self.max_every)
        young = min(max(math.ceil(fraction / self.young_budget - 1e-9), 1), every)
        self._young_every[speculative] = young if fraction <= self.young_max_fraction else every
        far = math.ceil(fraction / self.far_budget - 1e-9)
        self._far_every[speculative] = min(max(far, every), self.max_every)

    def due(self, speculative: bool, young: bool = False, far: bool = False) -> bool:
        """Called once per planned round of this kind: True when it is to measure (at `far_budget` if `far`).

        The gap after a measured round is max(1, round(every·(0.5 + u))) for a uniform u drawn then and the
        interval current now, so a change of interval (an estimate, the end of the young phase) applies at once.
        """
        since = self.since[speculative]
        gap = self._gap(speculative, young, far)
        if since is None or since + 1 >= gap:
            self.since[speculative] = 0
            self._jitter[speculative] = self._rng.random()
            return True
        self.since[speculative] = since + 1
        return False

    def quiet_rounds(self, speculative: bool, young: bool = False, far: bool = False) -> int:
        """How many next `due` calls of this kind are sure to return False, asked after an unmeasured round (the
        interval changes when a measured round is observed): a caller may then `skip` them."""
        since = self.since[speculative]
        return 0 if since is None else max(self._gap(speculative, young, far) - 1 - since, 0)

    def _gap(self, speculative: bool, young: bool, far: bool = False) -> int:
        """Rounds from one measured round of this kind to the next: the interval current now, jittered."""
        every = self.every(speculative, young, far)
        return every if self.fixed is not None else max(1, round(every * (0.5 + self._jitter[speculative])))

    def skip(self, speculative: bool) -> None:
        """A `due` call known to return False (`quiet_rounds`)."""
        since = self.since[speculative]
        assert since is not None
        self.since[speculative] = since + 1

    def observe(self, shape: Shape, measured: bool, round_time: float, measure_time: float = 0.0) -> None:
        """A finished round: its shape, whether it measured, its seconds and (measured) its readouts' seconds."""
        if round_time <= 0.0:
            return
        if not measured:
            recent = self.unmeasured.get(shape)
            if recent is None:
                recent = self.unmeasured[shape] = deque(maxlen=BASELINE)
            recent.append(round_time)
            return
        baseline = self.unmeasured.get(shape)
        if baseline is not None and len(baseline) >= BASELINE_MIN:
            fraction = round_time / statistics.median(baseline) - 1.0
        elif round_time > measure_time > 0.0:
            fraction = measure_time / (round_time - measure_time)
        else:
            return
        self.fractions[shape[1] > 0].append(max(fraction, 0.0))
        self._update(shape[1] > 0)
