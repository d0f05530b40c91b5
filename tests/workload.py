"""A synthetic workload with a known truth, for outcome tests of the controller (no model involved).

Each phase has a batch size and a true agreement per depth. A round of plan (K, d) accepts, per request,
each draft token with probability α_d until the first rejection (the geometric model); a measured round
reports every depth's agreement on the committed positions, each bit drawn with its α independently of the
others (the planned depth's bits are the acceptance pattern itself). Its seconds are a true
`PassCost` profile's times a log-normal noise; a measured round takes the profile's extra readouts and
`measure_overhead` (a share of the round) more. `Workload.goodput(k, d, phase)` is the expected tokens per
second of a plan in a phase, which scores a controller's choices against the per-phase oracle.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from looped_spec.control.acceptance import markov_tokens
from looped_spec.control.passcost import PassCost
from looped_spec.control.plan import RoundFeedback, SpeculationPlan, round_feedback


@dataclass
class Phase:
    batch: int
    alpha: Sequence[float]  # [D] true agreement of depth j+1 with full depth (alpha[D-1] = 1)
    rounds: int
    context: float = 120.0


class Workload:
    def __init__(self, truth: PassCost, noise: float = 0.05, seed: int = 0, measure_overhead: float = 0.0) -> None:
        self.truth = truth
        self.noise = noise
        self.measure_overhead = measure_overhead
        self.rng = random.Random(seed)

    def seconds(self, k: int, d: int, batch: int, context: float) -> float:
        return float(self.truth.profile_seconds([k], [d], batch, context)[0])

    def goodput(self, k: int, d: int, phase: Phase) -> float:
        tokens = float(markov_tokens(phase.alpha[d - 1], 0.0, k)) if k else 1.0
        return phase.batch * tokens / self.seconds(k, d, phase.batch, phase.context)

    def oracle(self, phase: Phase, options: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], float]:
        """The best option of `options` in `phase` and its goodput."""
        best = max(options, key=lambda o: self.goodput(o[0], o[1], phase))
        return best, self.goodput(best[0], best[1], phase)

    def feedback(self, plan: SpeculationPlan, phase: Phase) -> RoundFeedback:
        rng, alpha, b = self.rng, phase.alpha, phase.batch
        k, d = plan.k, plan.d
        accepted = []
        for _ in range(b):
            a = 0
            while a < k and rng.random() < alpha[d - 1]:
                a += 1
            accepted.append(a)
        seconds = self.seconds(k, d, b, phase.context) * math.exp(rng.gauss(0.0, self.noise))
        measured = {}
        if plan.measure_depths:
            measured = self._readouts(alpha, k, d, accepted)
            seconds = seconds * (1.0 + self.measure_overhead) + self.truth.measure_seconds(k, d, b)
        return round_feedback(
            plan, batch_size=b, context=phase.context, num_proposed=[k] * b, num_accepted=accepted,
            seconds=seconds, **measured,
        )  # fmt: skip

    def _readouts(
        self, alpha: Sequence[float], k: int, d: int, accepted: list[int], alphas: Sequence | None = None,
        request_ids: Sequence[str] | None = None,
    ) -> dict:  # fmt: skip
        """What a measured round reports: per depth matches and trials, per request its own matches (requests keep
        their index as id across rounds, unless `request_ids`; `alphas`: each request's own agreement, else
        `alpha`)."""
        depth = len(alpha)
        matches, own = [0] * depth, []
        for i, a in enumerate(accepted):
            alpha = alpha if alphas is None else alphas[i]
            rows = []  # per committed position: bits per depth
            for j in range(a + 1):
                bits = [self.rng.random() < p for p in alpha]
                if k:  # the planned depth agreed on every accepted draft and disagreed at the rejection
                    bits[d - 1] = True if j < a else (bits[d - 1] if a == k else False)
                bits[-1] = True
                rows.append(bits)
            own.append([sum(bits[j] for bits in rows) for j in range(depth)])
            for j in range(depth):
                matches[j] += own[-1][j]
        positions = sum(accepted) + len(accepted)
        return {
            "depth_matches": matches, "depth_trials": [positions] * depth,
            "request_ids": list(request_ids or [str(i) for i in range(len(accepted))]), "request_matches": own,
            "request_trials": [a + 1 for a in accepted],
        }  # fmt: skip

    def static_batch(
        self,
        controller,
        alphas: Sequence[Sequence[float]],
        tokens: Sequence[int],
        context: float = 120.0,
        id_prefix: str = "",
    ) -> list[tuple[list[str], tuple[int, int]]]:
        """One batch of requests, each with its own agreement `alphas[i]` and `tokens[i]` to generate, decoded until
        the last finishes (a request leaves the batch when done); per round, the requests in it and the plan.
        Request i is `id_prefix` + str(i): batches after one another need their own prefixes, as the engine's
        requests have their own ids."""
        index = {f"{id_prefix}{i}": i for i in range(len(tokens))}
        left = {request_id: tokens[i] for request_id, i in index.items()}
        rounds = []
        while left:
            ids = list(left)
            own = [alphas[index[i]] for i in ids]
            plan = controller.plan(len(ids), context, ids)
            proposed = [min(plan.k, left[i] - 1) for i in ids]
            accepted = []
            for k, alpha in zip(proposed, own):
                a = 0
                while a < k and self.rng.random() < alpha[plan.d - 1]:
                    a += 1
                accepted.append(a)
            measured = self._readouts(alphas[0], plan.k, plan.d, accepted, own, ids) if plan.measure_depths else {}
            measured.setdefault("request_ids", ids)
            controller.observe(round_feedback(
                plan, batch_size=len(ids), context=context, num_proposed=proposed, num_accepted=accepted,
                seconds=self.seconds(plan.k, plan.d, len(ids), context), **measured,
            ))  # fmt: skip
            rounds.append((ids, (plan.k, plan.d)))
            for i, a in zip(ids, accepted):
                left[i] -= a + 1
                if left[i] <= 0:
                    del left[i]
        return rounds

    def run(self, controller, phases: Sequence[Phase]) -> list[list[tuple[int, int]]]:
        """Drive `controller` through the phases; the (K, d) it planned each round, per phase."""
        plans: list[list[tuple[int, int]]] = []
        for phase in phases:
            chosen = []
            for _ in range(phase.rounds):
                plan = controller.plan(phase.batch, phase.context)
                chosen.append((plan.k, plan.d))
                controller.observe(self.feedback(plan, phase))
            plans.append(chosen)
        return plans
