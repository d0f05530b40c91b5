"""A synthetic workload: `RoundFeedback` drawn from a known acceptance per depth and a known cost function.

No model involved. Used by the tests (convergence of the policies) and handy for trying presets:

    sim = SyntheticWorkload(full_depth=4, alpha=[0.6, 0.8, 0.9, 1.0])
    plan = controller.plan(batch)
    controller.observe(sim.feedback(plan, batch))

Acceptance: each draft token of a depth-d draft is accepted with probability alpha[d-1] until the first
rejection (the geometric model). Counterfactual depth agreement (when the plan asks for it): each
committed token agrees with the depth-j readout with probability alpha[j-1]. Phase times follow the
`RoundCostModel` shapes with the given coefficients, times (1 + noise·N(0, 1)), seeded.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass, field

from looped_spec.control.goodput import expected_tokens
from looped_spec.control.plan import RoundFeedback, SpeculationPlan


@dataclass
class SyntheticWorkload:
    """Known-truth feedback generator (seconds are arbitrary units)."""

    full_depth: int
    alpha: Sequence[float]  # [D] acceptance of a token drafted at depth j+1 (alpha[D-1] = 1)
    draft_step: tuple[float, float] = (1.0e-3, 2.0e-5)  # one-token-per-request loop step: a0 + a1·B
    verify_step: tuple[float, float] = (1.2e-3, 3.0e-5)  # multi-token loop step over N positions: b0 + b1·N
    commit: tuple[float, float] = (1.0e-4, 1.0e-6)  # per round: g0 + g1·positions
    noise: float = 0.03
    seed: int = 0
    timed: bool = True  # report phase times (False: all zero, as an engine without timers)
    rng: random.Random = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.alpha) != self.full_depth:
            raise ValueError(f"alpha has {len(self.alpha)} entries, expected full depth {self.full_depth}")
        self.rng = random.Random(self.seed)

    def phase_times(self, k: int, d: int, batch: int) -> tuple[float, float, float]:
        """Noise-free (draft, verify, commit) seconds; a plain round books everything as draft."""
        a0, a1 = self.draft_step
        b0, b1 = self.verify_step
        g0, g1 = self.commit
        depth = self.full_depth
        if k == 0:
            return depth * (a0 + a1 * batch), 0.0, g0 + g1 * batch
        positions = batch * (k + 1)
        return d * (k + 1) * (a0 + a1 * batch), (depth - d) * (b0 + b1 * positions), g0 + g1 * positions

    def goodput(self, k: int, d: int, batch: int) -> float:
        """True expected committed tokens per second."""
        tokens = 1.0 if k == 0 else expected_tokens(self.alpha[d - 1], k)
        return batch * tokens / sum(self.phase_times(k, d, batch))

    def best(self, options: Sequence[tuple[int, int]], batch: int) -> int:
        """Index of the option with the highest true goodput."""
        return max(range(len(options)), key=lambda i: self.goodput(options[i][0], options[i][1], batch))

    def feedback(self, plan: SpeculationPlan, batch: int) -> RoundFeedback:
        rng = self.rng
        depth = self.full_depth
        k, d = plan.k, plan.d
        proposed, accepted = [], []
        committed = 0
        for _ in range(batch):
            a = 0
            if k > 0:
                p = self.alpha[d - 1]
                while a < k and rng.random() < p:
                    a += 1
            proposed.append(k)
            accepted.append(a)
            committed += a + 1
        matches: list[int] = []
        trials: list[int] = []
        if plan.measure_depths:
            for j in range(depth):
                p = self.alpha[j]
                matches.append(committed if p >= 1.0 else sum(rng.random() < p for _ in range(committed)))
                trials.append(committed)
        times = [0.0, 0.0, 0.0]
        if self.timed:
            times = [max(t * (1.0 + self.noise * rng.gauss(0.0, 1.0)), 0.0) for t in self.phase_times(k, d, batch)]
        return RoundFeedback(
            plan_id=plan.plan_id,
            k=k,
            d=d,
            bucket=plan.bucket,
            candidate=plan.candidate,
            batch_size=batch,
            num_proposed=proposed,
            num_accepted=accepted,
            draft_time=times[0],
            full_depth_time=times[1],
            commit_time=times[2],
            depth_matches=matches,
            depth_trials=trials,
        )
