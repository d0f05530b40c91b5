"""Which rounds take counterfactual depth readouts: as often as a small time budget allows.

The goodput policy learns acceptance from counterfactual readouts (every shallower depth read out on the
committed positions, docs/adaptive.md "acceptance model"). Their cost is a property of the model: measured on
this project's CPU, every-round readouts cost 3 % of tiny-ouro's plain rounds, 4–5 % of tiny-nanbeige's and
20–40 % of tiny-huginn's (its readout runs the coda layers). A fixed interval is wrong for one of them either
way: every 32nd plain round wastes nothing on Huginn but gives a single stream 2 readouts per 64-token
generation on Ouro, where every 3rd would cost 1 %.

`MeasureSchedule` keeps, per kind of round (plain, speculative), the cost fraction f = readout seconds /
(round seconds − readout seconds) of the rounds it measured — the readout seconds are timed inside the round
(`RoundFeedback.measure_time`), so no two rounds are compared — and measures every ceil(f / budget)-th round
of that kind (median f of the last `WINDOW` measured rounds; the interval clamped to [min_every, max_every]).
The first round of each kind is measured, to learn f.
"""

from __future__ import annotations

import math
import statistics
from collections import deque

#: Share of decode time the readouts may take (1 %).
MEASURE_BUDGET = 0.01
#: Measured rounds whose cost fractions are kept per kind.
WINDOW = 8


class MeasureSchedule:
    """Decides per planned round whether it takes counterfactual readouts (see the module docstring).

    `every`: a fixed interval for both kinds instead (e.g. 1: every round, as tests and the tuner want).
    """

    def __init__(
        self,
        budget: float = MEASURE_BUDGET,
        min_every: int = 2,
        max_every: int = 64,
        every: int | None = None,
    ) -> None:
        if budget <= 0.0 or not 1 <= min_every <= max_every or (every is not None and every < 1):
            raise ValueError("need budget > 0, 1 <= min_every <= max_every and every >= 1")
        self.budget = budget
        self.min_every, self.max_every = min_every, max_every
        self.fixed = every
        self.fractions: dict[bool, deque[float]] = {False: deque(maxlen=WINDOW), True: deque(maxlen=WINDOW)}
        self.since: dict[bool, int | None] = {False: None, True: None}  # rounds since the last measured one

    def every(self, speculative: bool) -> int:
        """Current interval for this kind of round (1 = every round)."""
        if self.fixed is not None:
            return self.fixed
        kept = self.fractions[speculative]
        if not kept:
            return 1
        wanted = math.ceil(statistics.median(kept) / self.budget - 1e-9)
        return min(max(wanted, self.min_every), self.max_every)

    def due(self, speculative: bool) -> bool:
        """Called once per planned round of this kind: True when it is to measure."""
        since = self.since[speculative]
        if since is None or since + 1 >= self.every(speculative):
            self.since[speculative] = 0
            return True
        self.since[speculative] = since + 1
        return False

    def observe(self, speculative: bool, measure_time: float, round_time: float) -> None:
        """A measured round's readout seconds and its total seconds (readouts included)."""
        rest = round_time - measure_time
        if measure_time > 0.0 and rest > 0.0:
            self.fractions[speculative].append(measure_time / rest)
