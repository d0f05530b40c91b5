"""The controller's plans on loop passes: which plan each request's round runs under, and each plan's feedback.

The step engine asks the controller for a plan every round and reports the round when it is committed. On loop
passes requests enter new rounds at different passes; a plan serves the next request rounds entering, as many as
the batch had requests when it was taken (a step round's worth; a new plan when the batch size changes), and those
rounds finish at different passes. Its feedback goes to the controller once every request that ran under it
finished its round or left (preempted, aborted, failed) — a plan whose rounds all finished before it served its
last one reports again for the later ones — with what a step round reports except its time: rounds of several
plans share the passes, so no plan's round time is observed and the pass-cost model's drift factor does not learn
on loop passes (docs/architecture.md, "Loop-level batching").

A measured round's requests report [D, committed] agreement (`PassResult.agreement`), summed per plan and kept per
request, as a step round reports it.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import torch

from looped_spec.control.plan import RoundFeedback, SpeculationPlan, round_feedback
from looped_spec.loop_batching.items import PassResult
from looped_spec.request import Request, mean_context
from looped_spec.speculative.readouts import depth_trials


@dataclass
class _Open:
    """A plan whose rounds are not all finished, and what its finished rounds reported so far."""

    plan: SpeculationPlan
    batch_size: int
    context: float
    members: set[str]  # requests whose round under the plan runs
    request_ids: list[str] = field(default_factory=list)  # the finished rounds' requests, in the order below
    proposed: list[int] = field(default_factory=list)
    accepted: list[int] = field(default_factory=list)
    exit_depths: list[int] = field(default_factory=list)  # of every committed token (D where none exited early)
    exits: bool = False  # some request exited early
    matches: torch.Tensor | None = None  # [D] measured positions each depth agreed at
    trials: int = 0  # measured positions
    request_matches: list[list[int]] = field(default_factory=list)  # per finished request: [D] matches, ...
    request_trials: list[int] = field(default_factory=list)  # ... out of its committed positions (0: not measured)


class LoopRounds:
    """Plans in flight on loop passes; `finish` returns the feedback of the plans whose rounds all ended."""

    def __init__(self, depth: int, exit_skips: bool, readout_depths: Collection[int] | None = None) -> None:
        self.depth = depth
        self.exit_skips = exit_skips
        # the depths below full a measured round reads out (the runner's); None: every one
        self.readout_depths = range(1, depth) if readout_depths is None else readout_depths
        self._open: dict[int, _Open] = {}
        self._plan_of: dict[str, int] = {}  # request id -> the plan its round runs under
        self._plan: tuple[SpeculationPlan, int, float] | None = None  # the plan in use, its batch size and context
        self._plan_left = 0  # request rounds the plan in use still serves
        self._plan_k = 0  # the most drafts a request round under the plan in use drew (what the stats count it at)
        self.abandoned: list[SpeculationPlan] = []  # plans that will report nothing (`take_abandoned`)

    def plan(
        self, running: list[Request], take: Callable[[int, float, list[str]], SpeculationPlan]
    ) -> tuple[SpeculationPlan, bool]:
        """The plan for the requests entering a round in the next pass of the `running` batch, and whether it was just
        taken (`take(batch_size, context, request_ids)`, the controller's `plan`): a plan serves as many request
        rounds as the batch had requests when it was taken (a step round's worth), or until the batch size
        changes."""
        batch_size = len(running)
        if self._plan is not None and self._plan_left > 0 and self._plan[1] == batch_size:
            return self._plan[0], False
        context = mean_context(running)
        if self._plan is not None and self._plan_left == self._plan[1]:  # replaced before any round ran under it
            self.abandoned.append(self._plan[0])
        plan = take(batch_size, context, [r.request_id for r in running])
        self._plan, self._plan_left, self._plan_k = (plan, batch_size, context), batch_size, -1
        return self._plan[0], True

    def drew(self, k: list[int]) -> int | None:
        """The request rounds entering under the plan in use drew `k` drafts each (K capped as in a step round): the
        K the plan was counted at before (-1: not yet counted) when they drew more, else None. The stats count a plan
        as a step round is counted, at the most any of its rounds drew: a plan whose rounds all draw none (an exit
        rule that reads out through attention, a request's last token) is a plain round."""
        most = max(k, default=0)
        if most <= self._plan_k:
            return None
        counted, self._plan_k = self._plan_k, most
        return counted

    def start(self, requests: list[Request]) -> None:
        """`requests` entered a new round under the plan in use in a pass the engine committed."""
        if not requests:
            return
        plan, batch_size, context = self._plan
        self._plan_left -= len(requests)
        entry = self._open.get(plan.plan_id)
        if entry is None:
            entry = self._open[plan.plan_id] = _Open(plan, batch_size, context, set())
        entry.members.update(r.request_id for r in requests)
        for request in requests:
            self._plan_of[request.request_id] = plan.plan_id

    def finish(self, result: PassResult, in_flight: Collection[str]) -> list[RoundFeedback]:
        """Fold in a committed pass (`in_flight`: the requests with work in flight after it); the feedback of every
        plan none of whose rounds is still running."""
        touched: set[int] = set()
        for i, request in enumerate(result.finished):
            request_id = request.request_id
            entry = self._open.get(self._plan_of.pop(request_id, -1))
            if entry is None:
                continue
            entry.members.discard(request_id)
            touched.add(entry.plan.plan_id)
            entry.request_ids.append(request_id)
            entry.proposed.append(result.verified_proposed[i])  # the drafts the target checked
            entry.accepted.append(result.verified_accepted[i])
            tokens = len(result.tokens[i])
            depths = result.exit_depths[i] if result.exit_depths is not None else []
            entry.exits = entry.exits or bool(depths)
            entry.exit_depths.extend(depths[:tokens] if depths else [self.depth] * tokens)
            agreement = result.agreement[i] if result.agreement else None
            own = None if agreement is None else agreement.sum(1)  # [D] the request's matches per depth
            if own is not None:
                entry.matches = own if entry.matches is None else entry.matches + own
                entry.trials += agreement.shape[1]
            entry.request_matches.append([0] * self.depth if own is None else own.tolist())
            entry.request_trials.append(0 if agreement is None else agreement.shape[1])
        for request_id, plan_id in list(self._plan_of.items()):
            if request_id not in in_flight:  # left its round unfinished: it reports nothing
                del self._plan_of[request_id]
                self._open[plan_id].members.discard(request_id)
                touched.add(plan_id)
        feedback = []
        for plan_id in sorted(touched):
            entry = self._open[plan_id]
            if entry.members:
                continue
            del self._open[plan_id]
            if entry.proposed:
                feedback.append(self._feedback(entry))
            else:  # every request under it left its round unfinished
                self.abandoned.append(entry.plan)
        return feedback

    def take_abandoned(self) -> list[SpeculationPlan]:
        """The plans that will report nothing since the last call (the controller is told: `abandon`)."""
        plans, self.abandoned = self.abandoned, []
        return plans

    def _feedback(self, entry: _Open) -> RoundFeedback:
        measured = entry.matches is not None
        return round_feedback(
            entry.plan,
            batch_size=entry.batch_size,
            context=entry.context,
            num_proposed=entry.proposed,
            num_accepted=entry.accepted,
            seconds=0.0,  # not observed on loop passes (module docstring)
            depth_matches=entry.matches.tolist() if measured else (),
            depth_trials=depth_trials(entry.trials, self.depth, self.readout_depths) if measured else (),
            request_ids=entry.request_ids,
            request_matches=entry.request_matches if measured else (),
            request_trials=entry.request_trials if measured else (),
            exit_depths=entry.exit_depths if entry.exits else (),
            exit_skips=self.exit_skips,
        )
