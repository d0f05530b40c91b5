"""What a speculative round runs (SpeculationPlan) and what it reports back (RoundFeedback)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SpeculationPlan:
    """Fixed for one round (nothing changes it after `plan()`; not frozen only because a frozen dataclass costs
    2 µs to build against 0.5, once per round). `k == 0` means plain full-depth decoding with no speculative work.

    `bucket` / `candidate` locate the plan in the controller's preset (-1 for a fixed plan), so
    feedback updates exactly the (bucket, candidate) that produced the plan.
    """

    plan_id: int
    k: int
    d: int
    bucket: int = -1
    candidate: int = -1
    measure_depths: bool = False  # read out other depths for counterfactual acceptance (costs head projections)


@dataclass(slots=True)
class RoundFeedback:
    """Sent to the controller after a round's tokens and KV are committed.

    `depth_matches[j]` / `depth_trials[j]` count, over the round's committed positions, how often a
    greedy readout at depth j+1 agreed with the committed token (only where that depth's state
    existed: draft depths <= d, verifier depths > d). Empty when depths were not measured.
    """

    plan_id: int
    k: int
    d: int
    bucket: int
    candidate: int
    batch_size: int
    num_proposed: list[int]  # per request: K_actual
    num_accepted: list[int]  # per request: accepted draft tokens (excludes the bonus/corrected token)
    # seconds of the round's phases; `round_time` is their sum
    draft_time: float = 0.0  # loops 1..d, one position at a time (0 in a plain round)
    # the full-depth pass that decides the committed tokens, and the decision: loops d+1..D over the K+1
    # positions plus acceptance; in a plain round (k = 0, d = 0, nothing drafted) loops 1..D and the sample
    full_depth_time: float = 0.0
    commit_time: float = 0.0  # appending the tokens and releasing KV
    depth_matches: list[int] = field(default_factory=list)
    depth_trials: list[int] = field(default_factory=list)
    # early exit: the exit depth of every committed token's forward in this round (requests without early exit
    # count at full depth D); empty when no request of the round exits early. `exit_skips`: skip mode (the
    # loops after an exit are not run), else select mode (every loop runs)
    exit_depths: list[int] = field(default_factory=list)
    exit_skips: bool = False
    # of the round's seconds, those spent on the counterfactual readouts (control/measurement.py); 0 if none
    measure_time: float = 0.0

    @property
    def total_proposed(self) -> int:
        return sum(self.num_proposed)

    @property
    def total_accepted(self) -> int:
        return sum(self.num_accepted)

    @property
    def round_time(self) -> float:
        return self.draft_time + self.full_depth_time + self.commit_time
