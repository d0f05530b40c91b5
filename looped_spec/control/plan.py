"""The two messages between the engine and the controller: the plan of a round, and what the round reported.

`SpeculationPlan` is fixed for one round (the controller hands it out, the engine runs it). `RoundFeedback`
comes back after the round's tokens and KV are committed; `round_feedback` is the one place that builds it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpeculationPlan:
    """One round's plan: draft `k` tokens with the first `d` loops (`k == 0`: plain full-depth decoding).

    `bucket` / `candidate` locate the plan in the preset (-1 for a fixed plan), so feedback updates exactly the
    (bucket, candidate) that produced it. `measure_depths`: the round also reads out every depth on the
    committed positions (counterfactual acceptance; costs extra readouts).
    """

    plan_id: int
    k: int
    d: int
    bucket: int = -1
    candidate: int = -1
    measure_depths: bool = False
    stop_margin: float | None = None  # per-token stopping: a request stops drafting below this draft margin


@dataclass(slots=True, kw_only=True)
class RoundFeedback:
    """What one committed decode round tells the controller.

    `depth_matches[j]` / `depth_trials[j]`: over the round's committed positions, how often a greedy readout at
    depth j+1 agreed with the committed token (empty when the round did not measure depths); `depth_pairs[j]`:
    over consecutive committed positions of a request, [n1, n11, n0, n01] (the earlier position agreed, both did,
    the earlier did not, only the later did); `first_bits` / `last_bits`: per request (`request_ids`), its first and
    last committed position's agreement as a bit mask (bit j: depth j+1), for pairs across rounds. `num_proposed` /
    `num_accepted`: per request, drafted and accepted tokens, counting only drafts the target checked (under
    early exit a draft that exited within the draft depth is the target's own sample). `exit_depths`: the
    readout depth of every committed token when some request exits early, else empty.
    """

    plan_id: int
    k: int
    d: int
    bucket: int
    candidate: int
    batch_size: int
    context: float  # the batch's mean tokens in the KV per request at the round's start
    num_proposed: list[int]
    num_accepted: list[int]
    seconds: float  # the round's wall time, from scheduling to commit
    draft_seconds: float = 0.0  # of which the draft passes (0 in a plain round)
    depth_matches: list[int] = field(default_factory=list)
    depth_trials: list[int] = field(default_factory=list)
    depth_pairs: list[list[int]] = field(default_factory=list)
    request_ids: list[str] = field(default_factory=list)
    first_bits: list[int] = field(default_factory=list)
    last_bits: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)
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
