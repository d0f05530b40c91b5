"""Controllers the engine drives once per round: ``plan = c.plan(num_running, context, remaining)`` ...
``c.observe(feedback)``.

`context` is the batch's mean context (tokens already in the KV per request at the round's start), or None
when unknown; only the goodput policy with a context-aware cost profile uses it. `remaining` are the running
requests' token budgets left, passed only when no request waits; the goodput policy then prices plans by the
time to drain them (control/drain.py).

- `AdaptiveController`: batch size -> preset bucket -> the policy's candidate -> `SpeculationPlan`.
- `FixedController(k, d)`: always the same (K, d) (``speculation=SpeculativeConfig(k, d)``).
- `OffController`: always plain decoding (k = 0).

All of them number plans with a unique, increasing `plan_id`, accumulate the wall time spent inside
`plan()` / `observe()` in `overhead_seconds`, report counters in `stats()`, and optionally write every
plan, feedback and decision to a JSONL trace (`trace_path`, flushed by `close()`).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

from looped_spec.control.buckets import BucketTable, compile_buckets
from looped_spec.control.goodput import GoodputPolicy
from looped_spec.control.measurement import MeasureSchedule
from looped_spec.control.plan import RoundFeedback, SpeculationPlan
from looped_spec.control.policy import CandidatePolicy, Policy
from looped_spec.control.schema import AdaptiveSpecConfig
from looped_spec.control.trace import TraceWriter

POLICIES = ("goodput", "ema")
DEFAULT_POLICY = "goodput"
#: A batch stays in its bucket while its size is within this factor of the bucket's range (docs/adaptive.md
#: "bucket hysteresis"), so a batch hovering at an edge neither flips plans every round nor re-enters buckets.
BUCKET_STICKINESS = 1.25


class BaseController:
    """Shared bookkeeping: plan ids, overhead timing, trace, `stats()` and `close()`."""

    name = "base"
    #: Whether `plan` reads `remaining` (the engine builds that list each round only for a controller that does).
    uses_budgets = False

    def __init__(self, trace_path: str | Path | None = None) -> None:
        self.overhead_seconds = 0.0
        """Wall seconds spent inside plan() and observe() (including trace writes when tracing)."""
        self.num_plans = 0
        self.num_observed = 0
        self._next_id = 0
        self._trace = TraceWriter(trace_path) if trace_path is not None else None

    def plan(
        self, num_running: int, context: float | None = None, remaining: Sequence[int] | None = None
    ) -> SpeculationPlan:
        raise NotImplementedError

    def observe(self, feedback: RoundFeedback) -> None:
        t0 = perf_counter()
        self.num_observed += 1
        if self._trace is not None:
            self._trace.feedback(feedback)
        self.overhead_seconds += perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        """Counters and overhead; adaptive controllers add per-bucket state under "buckets"."""
        calls = self.num_plans + self.num_observed
        return {
            "controller": self.name,
            "plans": self.num_plans,
            "observed": self.num_observed,
            "overhead_seconds": self.overhead_seconds,
            "overhead_us_per_call": 1e6 * self.overhead_seconds / calls if calls else 0.0,
        }

    def close(self) -> None:
        """Flush and close the trace (if any). Safe to call twice."""
        if self._trace is not None:
            self._trace.close()


class FixedController(BaseController):
    """Always plans the same (k, d): k == 0 is plain decoding (d is then 0). `bucket`/`candidate` are -1."""

    name = "fixed"

    def __init__(
        self,
        k: int,
        d: int,
        full_depth: int | None = None,
        trace_path: str | Path | None = None,
        measure_depths: bool = False,
    ) -> None:
        if k < 0:
            raise ValueError(f"k={k} must be >= 0")
        if k > 0 and d < 1:
            raise ValueError(f"d={d} must be >= 1 when k={k}")
        if k > 0 and full_depth is not None and d >= full_depth:
            raise ValueError(f"d={d} must be < full depth {full_depth}")
        super().__init__(trace_path)
        self.k = k
        self.d = d if k > 0 else 0
        self.measure_depths = measure_depths

    def plan_shapes(self) -> list[tuple[int, int]]:
        """Every (K, d) this controller can hand out (K = 0 included), for sizing CUDA-graph capture."""
        return sorted({(0, 0), (self.k, self.d)})

    def plan(
        self, num_running: int, context: float | None = None, remaining: Sequence[int] | None = None
    ) -> SpeculationPlan:
        t0 = perf_counter()
        plan = SpeculationPlan(self._next_id, self.k, self.d, measure_depths=self.measure_depths)
        self._next_id += 1
        self.num_plans += 1
        if self._trace is not None:
            self._trace.plan(plan, num_running, context)
        self.overhead_seconds += perf_counter() - t0
        return plan


class OffController(FixedController):
    """Plain decoding every round (k = 0), with the same interface."""

    name = "off"

    def __init__(self, trace_path: str | Path | None = None) -> None:
        super().__init__(0, 0, trace_path=trace_path)


class AdaptiveController(BaseController):
    """Per-round (K, d) from a preset: batch size -> bucket -> the policy's current candidate.

    `policy`: "goodput" (default, `GoodputPolicy`) or "ema" (the EMA-threshold policy, `CandidatePolicy`).
    With "goodput" the plans ask the engine for counterfactual per-depth agreement (`measure_depths`) in the
    rounds `measure` (a `MeasureSchedule`) picks: as often as 1 % of the decode time allows.
    Bucket changes have hysteresis: the batch stays in the current bucket while its size is within
    `BUCKET_STICKINESS` of the bucket's range.
    The preset is checked (or rescaled, depth rule "scale") for `full_depth` and compiled into plain
    lists here, so `plan()` and `observe()` cost microseconds.
    """

    name = "adaptive"

    def __init__(
        self,
        config: AdaptiveSpecConfig,
        full_depth: int,
        policy: str = DEFAULT_POLICY,
        trace_path: str | Path | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
        self.config = config.for_depth(full_depth)
        self.full_depth = full_depth
        self.policy_name = policy
        buckets = compile_buckets(self.config)
        disable = self.config.disable
        self.measure_depths = policy == "goodput"  # the goodput policy learns acceptance from these readouts
        self._policy: Policy
        if policy == "ema":
            self._policy = CandidatePolicy(buckets, disable)
        else:
            self._policy = GoodputPolicy(
                buckets, disable, full_depth, acceptance=self.config.acceptance, cost=self.config.cost
            )
        self._measure = MeasureSchedule()
        self.uses_budgets = isinstance(self._policy, GoodputPolicy) and self._policy.prices_draining
        self._table = BucketTable(buckets)
        self._bucket = -1  # bucket of the previous plan
        # quiet rounds (docs/adaptive.md "Quiet rounds"): [batch size, rounds left] the policy vouched for
        self.quiet_path = True  # False: every round takes the full path (tests compare the two)
        self._quiet_batch = -1
        self._quiet_left = 0
        self._pending: list[RoundFeedback] = []  # feedback of quiet rounds, folded in before the next full round
        super().__init__(trace_path)

    @property
    def policy(self) -> Policy:
        """The policy, with every feedback observed so far folded in."""
        self._fold_pending_timed()
        return self._policy

    @policy.setter
    def policy(self, policy: Policy) -> None:
        self._fold_pending_timed()
        self._policy = policy

    @property
    def measure(self) -> MeasureSchedule:
        """The readout schedule, with every feedback observed so far folded in."""
        self._fold_pending_timed()
        return self._measure

    @measure.setter
    def measure(self, schedule: MeasureSchedule) -> None:
        self._fold_pending_timed()
        self._measure = schedule

    def _fold_pending_timed(self) -> None:
        if self._pending:
            t0 = perf_counter()
            self._fold_pending()
            self.overhead_seconds += perf_counter() - t0

    def _fold_pending(self) -> None:
        """Fold the feedback kept in quiet rounds into the schedule and the policy, in order."""
        pending, self._pending = self._pending, []
        for feedback in pending:
            self._fold(feedback)

    def _fold(self, feedback: RoundFeedback) -> None:
        if self.measure_depths:
            shape = (feedback.batch_size, feedback.k, feedback.d if feedback.k > 0 else 0)
            self._measure.observe(shape, bool(feedback.depth_trials), feedback.round_time, feedback.measure_time)
        policy = self._policy
        policy.observe(feedback)
        trace = self._trace
        if trace is not None and policy.last_event is not None:
            trace.decision(feedback.bucket, policy.last_event, feedback.plan_id)

    def bucket_for(self, num_running: int) -> int:
        """Bucket index a batch of `num_running` requests falls in (ignoring hysteresis)."""
        return self._table.lookup(num_running)

    def plan_shapes(self) -> list[tuple[int, int]]:
        """Every (K, d) this controller can hand out (K = 0 included), for sizing CUDA-graph capture."""
        shapes = {(0, 0)}
        for bucket in self.config.buckets:
            shapes.update((c.k, c.d) for c in bucket.candidates if c.k > 0)
        return sorted(shapes)

    def plan(
        self, num_running: int, context: float | None = None, remaining: Sequence[int] | None = None
    ) -> SpeculationPlan:
        """The plan for this round (batch of `num_running` requests at mean `context`); fixed until its feedback.

        `remaining`: the running requests' token budgets left, passed when no request waits (control/drain.py).
        """
        t0 = perf_counter()
        policy = self._policy
        trace = self._trace
        if self._quiet_left > 0 and num_running == self._quiet_batch:
            # a round the policy vouched for: same batch size (so the same bucket), nothing due but counters
            self._quiet_left -= 1
            bucket = self._bucket
            plan_id = self._next_id
            self._next_id = plan_id + 1
            k, d, cand = policy.repeat(bucket, context)
            if self.measure_depths:
                self._measure.skip(k > 0)
            plan = SpeculationPlan(plan_id, k, d, bucket, cand, False)
            self.num_plans += 1
            if trace is not None:
                trace.plan(plan, num_running, context)
            self.overhead_seconds += perf_counter() - t0
            return plan
        self._quiet_left = 0
        if self._pending:
            self._fold_pending()
        bucket = self._table.lookup_sticky(num_running, self._bucket, BUCKET_STICKINESS)
        if bucket != self._bucket:
            if self._bucket >= 0:
                policy.enter(bucket)
                if trace is not None and policy.last_event is not None:
                    trace.decision(bucket, policy.last_event, self._next_id - 1)
            self._bucket = bucket
        plan_id = self._next_id
        self._next_id = plan_id + 1
        k, d, cand = policy.select(bucket, num_running, plan_id, context, remaining)
        # a probe pair is timed in the plans' full shape: its two rounds leave their readouts to the next round
        far = k == 0 and policy.readouts_far(bucket)  # nothing near a switch: readouts at the far budget
        measure = (
            self.measure_depths
            and not policy.times_round(bucket, plan_id)
            and self._measure.due(k > 0, policy.acceptance_young, far)
        )
        plan = SpeculationPlan(plan_id, k, d, bucket, cand, measure)
        if self.quiet_path and not measure:  # a measured round's feedback may move the readout interval
            quiet = policy.quiet_rounds(bucket, num_running, (k, d, cand))
            if quiet and self.measure_depths:
                quiet = min(quiet, self._measure.quiet_rounds(k > 0, policy.acceptance_young, far))
            self._quiet_batch, self._quiet_left = num_running, quiet
        self.num_plans += 1
        if trace is not None:
            if policy.last_event is not None:
                trace.decision(bucket, policy.last_event, plan_id)
            trace.plan(plan, num_running, context)
        self.overhead_seconds += perf_counter() - t0
        return plan

    def observe(self, feedback: RoundFeedback) -> None:
        """Fold in a committed round; updates only the (bucket, candidate) the feedback's plan carried.

        While the next round is quiet nothing reads the feedback before the next full round, so it is kept and
        folded in then, in order, with the others (docs/adaptive.md "Quiet rounds"): one warm loop instead of
        every round's cold one. `policy`, `measure` and `stats()` fold it in before they answer.
        """
        t0 = perf_counter()
        self.num_observed += 1
        if self._trace is not None:
            self._trace.feedback(feedback)
        if self._quiet_left > 0:
            self._pending.append(feedback)
        else:
            if self._pending:
                self._fold_pending()
            self._fold(feedback)
        self.overhead_seconds += perf_counter() - t0

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(policy=self.policy_name, model=self.config.model, buckets=self.policy.describe())
        if self.measure_depths:  # how often rounds take counterfactual readouts now (control/measurement.py)
            out["measure_every"] = {
                "plain": self.measure.every(False),
                "plain_far": self.measure.every(False, far=True),
                "speculative": self.measure.every(True),
            }
        return out
