"""A speculative plan's round cost checked against plain decoding side by side, not hours apart.

The goodput policy prices plans with the preset's cost profile, measured when the preset was tuned. This
machine's speed drifts, and not by one factor for every plan: on 2026-11-30 at 22:30 UTC a tiny-ouro plain
round at B = 32 took 8–15 ms where the profile (tuned at 17:08) says 24 ms, and a (3, 1) round cost 2.8x a
plain one at the short contexts of random-token prompts where the profile says 2.0x; adaptive ran (2, 3)
there at 0.88x plain. Timing a plan's rounds against plain rounds from minutes earlier mixes in the drift
between them (±10–30 % here: why the policy's `refine_cost` is off by default).

A probe is two plain rounds run in place of two rounds of the speculative plan in use; the second is the one
timed. The first is a lead-in: a plain round right after speculative ones runs slower than in a stream of plain
rounds (tiny-ouro at B = 1, 2026-12-02: 5-9 % slower, the next ones within 1-2 %; between two speculative plans no
such step was seen), and pricing it made every plan look 5-9 % cheaper against plain than a fixed engine measures.
The plan's next round of the same batch size and full shape (every request drafting K, no counterfactual readouts)
is compared with the timed one: each priced by the profile at its own context, the pair's ratio

    (measured ÷ predicted of the plan's round) ÷ (measured ÷ predicted of the plain probe)

is the plan's cost error relative to plain decoding, taken at one moment. The median of a plan's last
`PROBE_WINDOW` pairs, once `PROBE_MIN` are in, scales its predicted round time (`factor`), and their spread
says how far that median can be trusted (`error`): the goodput policy asks a plan priced by its probes to clear
plain decoding by PROBE_Z standard errors too. A probe is due
every `PROBE_EVERY` rounds of a plan (every `PROBE_EVERY_NEW` until it has `PROBE_MIN` pairs), and only while
its predicted tokens/s is within `PROBE_BAND` of plain decoding's: where speculation pays far more than any cost
error (tiny-huginn, 1.3–1.8x plain) a plain round only loses time. Each probe costs the plan's gain over plain
for two rounds (≤ 0.2 of a round's time each inside the band).

Beyond the band plain rounds only cost time, yet the choice *between* speculative plans still rests on the
profile, and a profile taken on another day ranks them wrongly: on 2026-12-01 tiny-huginn's profile put (5, 1)
at B = 1 at 0.84 of (4, 2), which ran, while (5, 1) measured 1.1–1.3x faster (the machine ran 3x slower than when
it was tuned). So there a *rival probe* runs one round of a rival (another speculative plan beyond the band,
predicted at `RIVAL_FROM` of the plan in use or more) in place of the plan's round, and the plan's next round is
the reference: the pair's ratio, times the plan's own factor, is the rival's factor. A rival probe is due every
`rival_every` rounds of the plan: as often as costs `RIVAL_BUDGET` of the time at the predicted prices while the
rival has fewer than `PROBE_MIN` pairs (the fastest such rival first), then every `RIVAL_EVERY` rounds, rivals in
turn. A rival its pairs price *over* the plan in use, but not far enough over to clear the error bar of so few
pairs, is undecided: it is probed first and every `RIVAL_EVERY_MIN` rounds until it has `PROBE_WINDOW` pairs
(docs/adaptive.md "Rival probes").

A median of a few pairs is noisy (one pair's ratio varies by ~20 % at B = 1 on this machine), and the profile it
corrects is usually right within a few %: taken at face value, 16 pairs moved tiny-ouro's plans at B = 1 by ±5 %,
as much as separates them, and the policy ran (4, 1) or (3, 2) at 0.94-0.96x of (2, 2). So `factor` is the
posterior of the plan's cost error given its pairs under a two-part prior (`shrunk`): mostly a profile right within
PRIOR_NEAR, sometimes one off by a lot (another day's machine, PRIOR_FAR). A median within a standard error or two
of 1 is pulled most of the way back to the profile; one many standard errors out is kept nearly whole
(docs/adaptive.md "Plain probes").
"""

from __future__ import annotations

import math
import statistics
from collections import deque

#: Rounds of a speculative plan between two plain probes (while the plan is within PROBE_BAND of plain) ...
PROBE_EVERY = 16
#: ... and until the plan has PROBE_MIN pairs: a plan chosen at a static batch's start may have run its whole
#: batch before a probe every 16 rounds priced it (tiny-ouro, B = 32: ~19 rounds per 64-token batch).
PROBE_EVERY_NEW = 4
#: A plan predicted more than this much faster than plain decoding is not probed.
PROBE_BAND = 0.20
#: Probe pairs per plan whose median scales its predicted round time; the median needs this many first.
PROBE_WINDOW = 16
PROBE_MIN = 4
#: A plan priced by its probes must clear plain decoding's price by at least this many standard errors of their
#: median (`error`) as well as by the policy's margin: on a machine whose speed moves between two rounds, a
#: median of a few pairs can price a plan several % cheaper than it is, and a 2 % margin does not cover that.
PROBE_Z = 2.0
#: Standard error of the median of n normal samples ≈ MEDIAN_SE · σ / √n, and σ ≈ MAD_SIGMA · MAD.
MEDIAN_SE = 1.2533
MAD_SIGMA = 1.4826
#: Rival probes (beyond PROBE_BAND): a speculative option predicted at RIVAL_FROM of the plan in use or more is a
#: rival. One round of it runs in place of the plan's as often as costs RIVAL_BUDGET of the time at the prices
#: (a rival predicted 5 % under the plan every 5th round, 15 % under every 15th), every RIVAL_EVERY_MIN rounds at
#: most and RIVAL_EVERY at least; a rival with PROBE_MIN pairs every RIVAL_EVERY rounds.
RIVAL_FROM = 0.85
RIVAL_BUDGET = 0.01
RIVAL_EVERY_MIN = 4
RIVAL_EVERY = 32
#: The prior of a plan's cost error relative to plain (log of measured ÷ profile round time, against plain's): with
#: probability PRIOR_NEAR_WEIGHT the profile is right within PRIOR_NEAR (its errors on tiny-ouro at B = 1, measured
#: against fixed engines on the day it ran: −7 % to +5 %), else within PRIOR_FAR (profiles on another day's machine:
#: tiny-huginn's (5, 1) at B = 1 was 30 % dear, tiny-ouro's (2, 3) at B = 32 10 % cheap).
PRIOR_NEAR = 0.04
PRIOR_FAR = 0.25
PRIOR_NEAR_WEIGHT = 0.7


def rival_every(loss: float, rival_pairs: int, undecided: bool = False) -> int:
    """Rounds of the plan in use from one rival probe to the next, for a rival predicted `loss` (relative) under it
    (negative: over it). `undecided`: a rival predicted over the plan in use with fewer than PROBE_WINDOW pairs is
    probed at the rate of one without pairs, whatever its pairs (its probes cost nothing at the prices, and only more
    pairs narrow the error bar that keeps the plan in use)."""
    if rival_pairs >= PROBE_MIN and not undecided:
        return RIVAL_EVERY
    return min(max(math.ceil(loss / RIVAL_BUDGET - 1e-9), RIVAL_EVERY_MIN), RIVAL_EVERY)


class CostProbes:
    """Per bucket: when to probe, the pending probe's cost ratio, and per plan the pairs' ratios (relative to plain
    decoding: a rival's pairs are taken against the plan in use and carry that plan's factor)."""

    def __init__(self, num_buckets: int) -> None:
        self.since = [0] * num_buckets  # rounds of speculative plans since the bucket's last probe
        self.probe_plan = [-1] * num_buckets  # plan id of the bucket's outstanding probe
        self.lead = [False] * num_buckets  # a plain probe's lead-in round ran: its timed round is next
        # the probe round's (batch, measured ÷ predicted, k, d) while it waits for the round it pairs with
        self.pending: list[tuple[int, float, int, int] | None] = [None] * num_buckets
        self.ratios: dict[tuple[int, int, int], deque[float]] = {}  # (bucket, k, d) -> plain pairs' ratios
        # (bucket, k, d) -> rival pairs' ratios (times the reference plan's factor); kept apart from the plain pairs,
        # which price a plan against plain directly and take precedence: a rival pair carries two plans' round noise
        # and the reference's factor, and mixed into a plan's plain window its spread raised the plan's bar over
        # plain (tiny-ouro, B = 1, 2026-12-02: (2, 1) left for plain decoding for eight generations)
        self.rival_ratios: dict[tuple[int, int, int], deque[float]] = {}
        self.prior = True  # price with the prior (`shrunk`); False: the pairs' median as it is (an A/B switch)
        self._posteriors: dict[tuple, tuple[float, float]] = {}  # (prior, *window) -> (factor, error)

    def due(
        self, bucket: int, plan_id: int, k: int, d: int, rate: float, plain_rate: float, eager: bool = False
    ) -> bool:
        """Called when the bucket is about to run speculative plan (K, d), predicted at `rate` tokens/s against
        plain decoding's `plain_rate`: True when this round is to be a plain probe instead. `eager`: probe every
        PROBE_EVERY_NEW rounds whatever the plan's pairs (a plan on trial to gather evidence)."""
        if rate > plain_rate * (1.0 + PROBE_BAND):
            self.since[bucket] += 1
            return False
        if self.lead[bucket]:  # the lead-in ran: this round is the timed plain round
            self.lead[bucket] = False
            self.probe_plan[bucket] = plan_id
            return True
        if self.due_rival(bucket, plan_id, self._every(bucket, k, d, eager)):
            self.probe_plan[bucket] = -1  # this round is the lead-in, not timed
            self.lead[bucket] = True
            return True
        return False

    def due_rival(self, bucket: int, plan_id: int, every: int) -> bool:
        """Counts a round of the plan in use towards a probe due every `every` rounds (a rival probe: called instead
        of `due` when the plan is beyond PROBE_BAND over plain and has a rival, `rival_every`): True when this round
        is to be the probe instead."""
        self.since[bucket] += 1
        if self.since[bucket] < every:
            return False
        self.since[bucket] = 0
        self.probe_plan[bucket] = plan_id
        return True

    def rival_quiet_rounds(self, bucket: int, every: int) -> int:
        """How many next `due_rival` calls at this interval are sure to return False."""
        return max(every - 1 - self.since[bucket], 0)

    def quiet_rounds(self, bucket: int, k: int, d: int, rate: float, plain_rate: float) -> int:
        """How many next `due` calls of plan (K, d) at these rates are sure to return False (a large number
        outside PROBE_BAND): the pairs that set the interval change only by a probe."""
        if rate > plain_rate * (1.0 + PROBE_BAND):
            return 1 << 30
        return self.rival_quiet_rounds(bucket, self._every(bucket, k, d))

    def _every(self, bucket: int, k: int, d: int, eager: bool = False) -> int:
        """Rounds of plan (K, d) from one probe to the next."""
        return PROBE_EVERY if not eager and self.pairs(bucket, k, d) >= PROBE_MIN else PROBE_EVERY_NEW

    def interrupt(self, bucket: int) -> None:
        """The bucket runs a round no probe counts (plain decoding as its plan): a lead-in waiting for its timed
        round, or a plain probe waiting for its pair, is dropped. A pair stands for one moment; kept, it waited for
        the next speculative round however late, and while it waited the bucket took no readouts (`wants`) and no
        quiet rounds (`idle`) - ~300 rounds of tiny-nanbeige at B = 1 after a trial ended on plain decoding."""
        self.lead[bucket] = False
        pending = self.pending[bucket]
        if pending is not None and pending[2] <= 0:
            self.pending[bucket] = None

    def idle(self, bucket: int) -> bool:
        """No probe outstanding in `bucket` (its lead-in included) and no probe waiting for its pair round."""
        return self.probe_plan[bucket] < 0 and self.pending[bucket] is None and not self.lead[bucket]

    def wants(self, bucket: int, plan_id: int) -> bool:
        """Whether the feedback of `plan_id` is a probe or the round right after one (else `observe` is a no-op:
        the caller need not price the round)."""
        return plan_id == self.probe_plan[bucket] or self.pending[bucket] is not None

    def observe(self, bucket: int, plan_id: int, k: int, d: int, batch: int, ratio: float, full_shape: bool) -> None:
        """A round's measured ÷ profile-predicted seconds (`full_shape`: every request drafted K, no readouts).

        A plain probe pairs with the round right after it when that round is speculative, and prices its plan (a
        plain round there drops it); a rival probe (K > 0) pairs with the next round, which is the plan in use, and
        prices the rival in that plan's factor."""
        if plan_id == self.probe_plan[bucket]:
            self.probe_plan[bucket] = -1
            self.pending[bucket] = (batch, ratio, k, d) if full_shape else None
            return
        pending = self.pending[bucket]
        if pending is None:
            return
        self.pending[bucket] = None  # one pair per probe: the round right after it
        probe_batch, probe_ratio, probe_k, probe_d = pending
        if not full_shape or probe_batch != batch or probe_ratio <= 0.0 or ratio <= 0.0:
            return
        if probe_k <= 0:
            if k <= 0:
                return  # a plain probe pairs with a speculative round only
            pairs = self.ratios.setdefault((bucket, k, d), deque(maxlen=PROBE_WINDOW))
            pairs.append(ratio / probe_ratio)
        elif k > 0 and (k, d) != (probe_k, probe_d):
            pairs = self.rival_ratios.setdefault((bucket, probe_k, probe_d), deque(maxlen=PROBE_WINDOW))
            pairs.append(probe_ratio / ratio * self.factor(bucket, k, d))

    def pairs(self, bucket: int, k: int, d: int) -> int:
        """Plain probe pairs of (K, d) kept (at most PROBE_WINDOW)."""
        pairs = self.ratios.get((bucket, k, d))
        return 0 if pairs is None else len(pairs)

    def rival_pairs(self, bucket: int, k: int, d: int) -> int:
        """Rival probe pairs of (K, d) kept (at most PROBE_WINDOW)."""
        pairs = self.rival_ratios.get((bucket, k, d))
        return 0 if pairs is None else len(pairs)

    def _window(self, bucket: int, k: int, d: int) -> deque[float] | None:
        """The pairs that price (K, d): its plain pairs once PROBE_MIN, else its rival pairs once PROBE_MIN."""
        if k <= 0:
            return None
        for ratios in (self.ratios, self.rival_ratios):
            pairs = ratios.get((bucket, k, d))
            if pairs is not None and len(pairs) >= PROBE_MIN:
                return pairs
        return None

    def _posterior(self, bucket: int, k: int, d: int) -> tuple[float, float]:
        """(factor, relative standard error) of (K, d) from its window (`_window`): (1.0, 0.0) without one."""
        pairs = self._window(bucket, k, d)
        if pairs is None or min(pairs) <= 0.0:
            return 1.0, 0.0
        key = (self.prior, *pairs)  # a decision asks for every option's factor and error: computed once per window
        known = self._posteriors.get(key)
        if known is None:
            if len(self._posteriors) >= 256:
                self._posteriors.clear()
            known = self._posteriors[key] = self._compute_posterior(pairs)
        return known

    def _compute_posterior(self, pairs: deque[float]) -> tuple[float, float]:
        """(factor, error) of a window of pairs: their log median and its standard error, through `shrunk`."""
        logs = [math.log(x) for x in pairs]
        median = statistics.median(logs)
        mad = statistics.median(abs(x - median) for x in logs)
        se = MEDIAN_SE * MAD_SIGMA * mad / len(logs) ** 0.5
        if not self.prior:
            return math.exp(median), se
        mean, sd = shrunk(median, se)
        return math.exp(mean), sd

    def error(self, bucket: int, k: int, d: int) -> float:
        """Relative standard error of `factor` (from the spread of its pairs - robust: their median absolute
        deviation - and the prior, `shrunk`), 0.0 while `factor` is 1.0 for want of pairs."""
        return self._posterior(bucket, k, d)[1]

    def factor(self, bucket: int, k: int, d: int) -> float:
        """Measured ÷ profile round time of (K, d) relative to plain decoding's: the median of its plain pairs, or
        of its rival pairs while it has fewer than PROBE_MIN plain ones, pulled towards 1.0 (the profile) as far as
        their spread leaves it near it (`shrunk`); 1.0 until PROBE_MIN of either."""
        return self._posterior(bucket, k, d)[0]


def shrunk(median: float, se: float) -> tuple[float, float]:
    """Posterior mean and standard deviation of a log cost error whose pairs' median is `median` with standard error
    `se`, under the prior PRIOR_NEAR_WEIGHT · N(0, PRIOR_NEAR²) + (1 − PRIOR_NEAR_WEIGHT) · N(0, PRIOR_FAR²).

    Each part alone is the normal-normal update (the median shrunk by prior var ÷ (prior var + se²)); the parts are
    weighed by how likely each makes the median (a median of N(0, prior var + se²)). With se = 0 it is the median."""
    parts = []
    for weight, sd in ((PRIOR_NEAR_WEIGHT, PRIOR_NEAR), (1.0 - PRIOR_NEAR_WEIGHT, PRIOR_FAR)):
        var = sd * sd + se * se
        likelihood = weight * math.exp(-0.5 * median * median / var) / math.sqrt(var)
        gain = sd * sd / var
        parts.append((likelihood, gain * median, gain * se * se))  # (weight, posterior mean, posterior variance)
    total = sum(p[0] for p in parts)
    mean = sum(w * m for w, m, _ in parts) / total
    second = sum(w * (v + m * m) for w, m, v in parts) / total
    return mean, math.sqrt(max(second - mean * mean, 0.0))
