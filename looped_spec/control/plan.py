"""The two messages between the engine and the controller: the plan of a round, and what the round reported.

`SpeculationPlan` is fixed for one round (the controller hands it out, the engine runs it). `RoundFeedback`
comes back after the round's tokens and KV are committed; `round_feedback` is the one place that builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpeculationPlan:
    """One round's plan: draft `k` tokens with the first `d` loops (`k == 0`: plain full-depth decoding)."""

    plan_id: int
    k: int
    d: int
    # where the plan sits in the preset (-1: a fixed plan), so feedback updates the (bucket, candidate) that made it
    bucket: int = -1
    candidate: int = -1
    measure_depths: bool = False  # also read out other depths on the committed positions (counterfactual acceptance)
    stop_margin: float | None = None  # per-token stopping: a request stops drafting below this draft margin


@dataclass(slots=True, kw_only=True)
class RoundFeedback:
    """What one committed decode round tells the controller (the readouts' fields empty unless it measured depths)."""

    plan_id: int
    k: int
    d: int
    bucket: int
    candidate: int
    batch_size: int
    context: float  # the batch's mean tokens in the KV per request at the round's start
    # per request, drafted and accepted tokens, counting only drafts the target checked (under early exit a draft
    # that exited within the draft depth is the target's own sample)
    num_proposed: list[int]
    num_accepted: list[int]
    seconds: float  # the round's wall time, from scheduling to commit
    draft_seconds: float = 0.0  # of which the draft passes (0 in a plain round)
    # [D]: over the committed positions, how often a greedy readout at depth j+1 agreed with the committed token
    depth_matches: list[int] = field(default_factory=list)
    depth_trials: list[int] = field(default_factory=list)
    # the requests of num_proposed, num_accepted, ... below (on loop passes a request that ran two rounds under the
    # plan is named once per round)
    request_ids: list[str] = field(default_factory=list)
    # per request of a measured round, [D] matches over its committed positions, and how many it committed
    request_matches: list[list[int]] = field(default_factory=list)
    request_trials: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)  # each committed token's readout depth if any exits early
    exit_skips: bool = False  # early exit in skip mode: the loops after an exit were not run

    @property
    def total_proposed(self) -> int:
        return sum(self.num_proposed)

    @property
    def total_accepted(self) -> int:
        return sum(self.num_accepted)


def round_feedback(plan: SpeculationPlan, **fields: Any) -> RoundFeedback:
    """The feedback of a round that ran `plan`: the round's fields by keyword only (so no two are swapped silently,
    and a misspelt one is an error)."""
    return RoundFeedback(
        plan_id=plan.plan_id, k=plan.k, d=plan.d, bucket=plan.bucket, candidate=plan.candidate, **fields
    )
