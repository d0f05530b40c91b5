"""Controllers: the engine asks `plan(batch_size, context, request_ids)` before every decode round and sends
`observe(feedback)` after its commit. `FixedController(k, d)` plans the same every round; `AdaptiveController`
follows a preset (docs/adaptive.md). Both number plans with increasing ids, time themselves (`overhead_seconds`) and
can write a JSONL trace of every plan, feedback and decision (`trace_path`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path
from time import perf_counter
from typing import Any

from looped_spec.control.acceptance import AcceptanceEstimator
from looped_spec.control.buckets import BucketTable, compile_buckets
from looped_spec.control.ema import EmaPolicy
from looped_spec.control.exits import ExitDepths
from looped_spec.control.goodput import GoodputPolicy
from looped_spec.control.passcost import PRICE_PRIOR, PassCost
from looped_spec.control.plan import RoundFeedback, SpeculationPlan
from looped_spec.control.settings import ControlSettings
from looped_spec.control.trace import TraceWriter
from looped_spec.presets.schema import AdaptiveSpecConfig

POLICIES = ("goodput", "ema")
DEFAULT_POLICY = "goodput"
#: Rounds running this many times faster or slower than the preset's profile predicts say it was timed on another
#: machine state, whose relative costs of plans need not hold here (docs/benchmarking.md, "Another machine")
FAR_DRIFT = 2.0

logger = logging.getLogger(__name__)


class FixedController:
    """Always the same (k, d); k = 0 is plain decoding. `measure_depths`: every round also reads out every depth."""

    name = "fixed"

    def __init__(
        self, k: int, d: int, trace_path: str | Path | None = None, measure_depths: bool = False,
        stop_margin: float | None = None,
    ) -> None:  # fmt: skip
        if k < 0 or (k > 0 and d < 1):
            raise ValueError(f"(k={k}, d={d}): need k >= 0, and d >= 1 when k > 0")
        if stop_margin is not None and (k == 0 or measure_depths):  # as SpeculativeConfig (engine/config.py) refuses
            raise ValueError(f"stop_margin={stop_margin}: needs k > 0 and no measure_depths (a measured round, and "
                             "plain decoding, draft every k)")  # fmt: skip
        self.k, self.d = k, d if k > 0 else 0
        self.measure_depths = measure_depths
        self.stop_margin = stop_margin
        self.num_plans = self.num_observed = self.num_abandoned = 0
        self.overhead_seconds = 0.0
        self._trace = TraceWriter(trace_path) if trace_path is not None else None

    def plan_shapes(self) -> list[tuple[int, int]]:
        """Every (K, d) this controller can hand out (K = 0 included), for sizing CUDA-graph capture."""
        return sorted({(0, 0), (self.k, self.d)})

    def readout_depths(self) -> list[int] | None:
        """The depths below full a measured round reads out (None: every one)."""
        return None

    def plan(self, batch_size: int, context: float, request_ids: Sequence[str] = ()) -> SpeculationPlan:
        """The plan of the next round (a batch of `batch_size` requests at mean context `context`; `request_ids`:
        the batch's requests, when the caller knows them)."""
        t0 = perf_counter()
        plan, event = self._next_plan(batch_size, context, request_ids)
        self.num_plans += 1
        if self._trace is not None:
            self._trace.plan(plan, batch_size, context, event)
        self.overhead_seconds += perf_counter() - t0
        return plan

    def observe(self, feedback: RoundFeedback) -> None:
        """Fold in a committed round."""
        t0 = perf_counter()
        self.num_observed += 1
        event = self._learn(feedback)
        if self._trace is not None:
            self._trace.feedback(feedback, event)
        self.overhead_seconds += perf_counter() - t0

    def abandon(self, plan: SpeculationPlan) -> None:
        """A planned round that did not run (its requests were preempted before it, or it failed and committed
        nothing; on loop passes, a plan none of whose rounds finished): no feedback will come for it."""
        self.num_abandoned += 1
        self._forget(plan)
        if self._trace is not None:
            self._trace.write("abandon", plan_id=plan.plan_id)

    def _forget(self, plan: SpeculationPlan) -> None:
        """Undo what handing out `plan` set waiting for its feedback."""

    def _next_plan(
        self, batch_size: int, context: float, request_ids: Sequence[str]
    ) -> tuple[SpeculationPlan, str | None]:
        """The next plan, and the decision behind it to trace (None: none this round)."""
        plan = SpeculationPlan(
            self.num_plans, self.k, self.d, measure_depths=self.measure_depths, stop_margin=self.stop_margin
        )
        return plan, None

    def _learn(self, feedback: RoundFeedback) -> str | None:
        """What a committed round teaches; returns the decision it caused, to trace (None: none)."""
        return None

    def stats(self) -> dict[str, Any]:
        calls = self.num_plans + self.num_observed
        return {
            "controller": self.name,
            "plans": self.num_plans,
            "observed": self.num_observed,
            "abandoned": self.num_abandoned,
            "overhead_seconds": self.overhead_seconds,
            "overhead_us_per_call": 1e6 * self.overhead_seconds / calls if calls else 0.0,
        }

    def flush_trace(self) -> None:
        """Write out the buffered trace lines (if tracing), so a reader can follow a live trace."""
        if self._trace is not None:
            self._trace.flush()

    def close(self) -> None:
        """Flush and close the trace (if any). Safe to call twice."""
        if self._trace is not None:
            self._trace.close()


class AdaptiveController(FixedController):
    """Per-round (K, d) from a preset: batch size -> bucket -> the policy's option. It feeds every round to the
    shared estimators (acceptance, pass-cost drift, exit depths) and decides which rounds also read out the depths its
    policy reads (docs/adaptive.md "Which rounds read out")."""

    name = "adaptive"

    def __init__(
        self,
        config: AdaptiveSpecConfig,
        full_depth: int,
        policy: str = DEFAULT_POLICY,
        settings: ControlSettings | None = None,
        trace_path: str | Path | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy={policy!r} must be one of {POLICIES}")
        if config.full_depth != full_depth:
            raise ValueError(f"the preset is for depth {config.full_depth}, the model has {full_depth} (for_depth)")
        super().__init__(0, 0, trace_path)
        self.config = config
        self.settings = s = settings or ControlSettings()
        self.policy_name = policy
        buckets = compile_buckets(config)
        # the agreements the policy reads (docs/adaptive.md "Only the depths plans draft at"): the goodput policy prices
        # every option's draft depth, the EMA policy's probes read its most conservative speculative candidate's
        if policy == "ema":
            self._read = sorted({b.ds[b.lowest_spec] for b in buckets if b.lowest_spec >= 0})
        else:
            self._read = sorted({d for b in buckets for k, d in b.options if k > 0})
        # per draft depth (0: plain), whether a measured round has a depth to read besides it: a round's drafts report
        # the agreement at their own depth anyway, so a speculative round with none is not measured
        self._reads_beside = [any(j != d for j in self._read) for d in range(full_depth)]
        acc = config.acceptance
        self.acceptance = AcceptanceEstimator(
            full_depth, acc.alpha if acc else None, acc.rho if acc else None, s.prior_share * s.acceptance_memory,
            s.acceptance_memory, s.request_memory, s.prior_share * s.request_memory,
        )  # fmt: skip
        options = [o for b in buckets for o in b.options]
        self.cost = PassCost(config.cost, full_depth, s.drift_rounds, options, self._read)
        self.exits = ExitDepths(full_depth, s.acceptance_memory)
        if policy == "ema":
            self.policy: GoodputPolicy | EmaPolicy = EmaPolicy(buckets, config.disable, self.acceptance)
        else:
            self.policy = GoodputPolicy(buckets, self.acceptance, self.cost, self.exits, s)
        self.buckets = buckets
        self._table = BucketTable(buckets, s.bucket_stickiness)
        self._bucket = -1
        self._measure_in = 0  # rounds until the next measured round
        self._far_drift_told = False
        # plain rounds beside a speculative plan, pricing speculation against plain on this machine (goodput only;
        # docs/adaptive.md "Prices on another machine")
        self._probes = policy == "goodput"
        self._probe_in = s.price_probe_interval
        self._probe_plan = -1  # the plan id of the price probe in flight
        self._rival_turn = False  # beside a speculative plan, probes alternate: plain, a rival, plain, ...
        # the last ordinary round (a measured round's and a price probe's partner): (plan id, bucket, (K, d),
        # log measured ÷ profile seconds)
        self._last_ordinary: tuple[int, int, tuple[int, int], float] | None = None

    def plan_shapes(self) -> list[tuple[int, int]]:
        return sorted({(0, 0)} | {o for b in self.buckets for o in b.options})

    def readout_depths(self) -> list[int]:
        return self._read

    def _next_plan(
        self, batch_size: int, context: float, request_ids: Sequence[str]
    ) -> tuple[SpeculationPlan, str | None]:
        self.acceptance.set_batch(request_ids)
        bucket = self._table.lookup_sticky(batch_size, self._bucket)
        if bucket != self._bucket:
            if self._bucket >= 0:
                self.policy.enter(bucket)
            self._bucket = bucket
            # a countdown to the next measured round set at a larger batch (about one a request per measured round)
            # would hold this batch's readouts back as long: at most this batch's own position target
            self._measure_in = min(self._measure_in, math.ceil(batch_size / self.settings.readout_positions))
        k, d, candidate = self.policy.select(bucket, batch_size, context, self.num_plans)
        event = self.policy.last_event
        measure = self._measure_in <= 0 and self._reads_beside[d]
        probe = self._probes and self.buckets[bucket].may_run_plain and self.cost.ordinary_rounds  # rounds are timed
        if probe and not measure:
            self._probe_in -= 1
        # a probe is due, in a round the policy did not just decide (the decision stays in the trace)
        if probe and self._probe_in <= 0 and event is None:
            rival = self._rival(bucket, k, d)
            if k == 0 and rival is None:  # plain, and no speculative option near it: nothing to price
                self._probe_in = self.settings.price_probe_interval
            else:
                measure = False  # the probe and the round before it are both ordinary (a measured round waits)
                last = self._last_ordinary
                # right after an ordinary round of this plan in the same bucket (a batch of about its size)
                if last is not None and last[0] == self.num_plans - 1 and last[1] == bucket and last[2] == (k, d):
                    event, (k, d), candidate = self._probe_plan_beside(bucket, k, d, rival)
        if measure:
            outlook = self.policy.outlook(bucket)
            measure = outlook > 0.0  # 0: readouts would change nothing now
            self._measure_in = self._readout_interval(k, d, batch_size, context, outlook) if measure else 0
        self._measure_in -= 1
        return SpeculationPlan(self.num_plans, k, d, bucket, candidate, measure), event

    def _rival(self, bucket: int, k: int, d: int) -> tuple[int, int] | None:
        """The speculative option to price beside (K, d) in `bucket`, if any: beside a speculative plan, once that
        plan's own price was read `PRICE_PRIOR` times."""
        if k > 0 and self.cost.own_pairs((bucket, k, d)) < PRICE_PRIOR:
            return None
        return self.policy.rival(bucket, 2 * PRICE_PRIOR)

    def _probe_plan_beside(
        self, bucket: int, k: int, d: int, rival: tuple[int, int] | None
    ) -> tuple[str, tuple[int, int], int]:
        """The price probe beside the plan in use (K, d): a plain round, or `rival`'s (every other probe beside a
        speculative plan, every probe beside plain); its event, plan and candidate index. The first pairs come one a
        decision (the profile's price counts as PRICE_PRIOR of them), and so do probes beside plain, then at pace."""
        interval = self.settings.price_probe_interval
        fast = self.cost.price_pairs < 2 * PRICE_PRIOR or k == 0
        self._probe_in = min(self.settings.decision_interval, interval) if fast else interval
        self._probe_plan = self.num_plans
        self._rival_turn = not self._rival_turn
        beside = f"(K={k}, d={d})" if k else "plain"
        if rival is not None and (k == 0 or self._rival_turn):
            candidate = self.policy.candidate[bucket][self.policy.options.index(rival)]
            return f"price probe: one (K={rival[0]}, d={rival[1]}) round beside {beside}", rival, candidate
        # the policy's plan stays in use
        return f"price probe: one plain round beside {beside}", (0, 0), self.buckets[bucket].plain_candidate

    def _readout_interval(self, k: int, d: int, batch: int, context: float, outlook: float) -> int:
        """Rounds per measured round (docs/adaptive.md "Which rounds read out"): the position target (a measured round
        reads at least one position per request), the cost budget times outlook² (readouts are worth what they may
        change), and at least two (the drift factor learns from the unmeasured rounds)."""
        s = self.settings
        by_time = self.cost.measure_share(k, d, batch, context) / (s.readout_budget * outlook * outlook)
        return max(2, math.ceil(by_time), math.ceil(batch / s.readout_positions))

    def _forget(self, plan: SpeculationPlan) -> None:
        if plan.plan_id == self._probe_plan:
            self._probe_plan = -1
        self.policy.abandon(plan)

    def _learn(self, fb: RoundFeedback) -> str | None:
        """Acceptance, exit depths, the cost drift, then the policy."""
        self.acceptance.observe_round(fb)
        if fb.exit_depths:
            self.exits.observe(fb.exit_depths, fb.exit_skips)
        else:  # a round without early exit: every committed token ran full depth (the earlier exits fade out)
            self.exits.observe_full_depth(len(fb.num_accepted) + fb.total_accepted)
        if fb.seconds > 0.0:
            self._observe_seconds(fb)
        self.policy.observe(fb)
        return self.policy.last_event

    def _observe_seconds(self, fb: RoundFeedback) -> None:
        """The round's time, as log(measured ÷ profile seconds): an ordinary round moves the drift factor; a measured
        one, with the ordinary round of its plan just before it, what measuring adds (the learned price, the same on
        both, cancels: it moves only at a probe, which would be the round between them); a price probe, with the
        round of the plan in use just before it, a speculative plan's price against plain: plain beside a speculative
        plan prices that plan, a speculative option beside plain that option, and a rival beside a speculative plan
        the rival, through the plan's own price."""
        probe = fb.plan_id == self._probe_plan
        if probe:
            self._probe_plan = -1
        k = fb.k if fb.total_proposed else 0
        plan = (k, fb.d if k else 0)
        profile = self.cost.seconds(*plan, fb.batch_size, fb.context, self.exits)
        if profile <= 0.0:
            return
        log_ratio = math.log(fb.seconds / profile)
        last = self._last_ordinary
        if fb.depth_trials:  # a measured round: beside the ordinary round of its bucket and plan just before it
            if last is not None and last[0] == fb.plan_id - 1 and last[1:3] == (fb.bucket, plan):
                self.cost.observe_measured_pair(log_ratio, last[3])
            return
        key = (fb.bucket, *plan)
        self.cost.observe(fb.seconds, profile, k > 0, key)
        self._tell_far_drift()
        if probe and last is not None and last[0] == fb.plan_id - 1 and last[1] == fb.bucket and last[2] != plan:
            memory, in_use = self.settings.price_memory, (fb.bucket, *last[2])
            if k == 0:  # plain beside the plan in use
                self.cost.observe_pair(last[3], log_ratio, memory, in_use)
            elif last[2][0] == 0:  # a speculative option beside plain
                self.cost.observe_pair(log_ratio, last[3], memory, key)
            else:  # a rival beside the speculative plan in use
                self.cost.observe_rival(log_ratio, last[3], memory, key, in_use)
        self._last_ordinary = (fb.plan_id, fb.bucket, plan, log_ratio)

    def _tell_far_drift(self) -> None:
        """Warn once when the drift factor, past its first memory of rounds, puts this machine far from the one the
        preset was timed on: its relative prices of plans may be off by several % (docs/benchmarking.md)."""
        cost = self.cost
        if self._far_drift_told or cost.ordinary_rounds < self.settings.drift_rounds:
            return
        if 1.0 / FAR_DRIFT <= cost.drift <= FAR_DRIFT:
            return
        self._far_drift_told = True
        logger.warning(
            "preset %r: rounds take %.2fx the time its pass-cost profile (%s) predicts; its plans are priced with the "
            "relative costs of another machine state (price probes correct the plans near the one in use only). Time a "
            "preset on this machine: looped-spec tune (README, 'Tune a preset')",
            self.config.model, cost.drift, self.config.hardware,
        )  # fmt: skip

    def stats(self) -> dict[str, Any]:
        out = super().stats()
        out.update(
            policy=self.policy_name,
            model=self.config.model,
            alpha=[round(a, 4) for a in self.acceptance.alpha],  # the preset's at a depth not read out
            readout_depths=self._read,
            batch_alpha=[round(a, 4) for a in self.acceptance.batch_alpha()],  # the last planned batch's
            rho=[round(r, 4) for r in self.acceptance.rho],
            acceptance_positions=self.acceptance.positions,
            cost_drift=round(self.cost.drift, 4),
            speculative_price=round(self.cost.speculative_factor(), 4),  # against plain, from the price probes
            price_pairs=self.cost.price_pairs,
            # each plan's own price in a bucket, once pairs read it: "bucket:K,d" -> price against plain
            own_prices={
                f"{self.buckets[b].label()}:{k},{d}": round(self.cost.speculative_factor((b, k, d)), 4)
                for b, k, d in self.cost.own_prices
                if 0 <= b < len(self.buckets)
            },
            buckets=self.policy.describe(),
        )
        return out


def make_controller(
    spec: str | tuple[int, int, bool] | tuple[int, int, bool, float | None],
    full_depth: int,
    preset: AdaptiveSpecConfig | None,
    *,
    policy: str = DEFAULT_POLICY,
    settings: ControlSettings | None = None,
    trace_path: str | Path | None = None,
) -> FixedController:
    """The controller for `spec`: "off", "adaptive" (with its `preset`, already fitted to `full_depth`) or a
    fixed (k, d, measure_depths[, stop_margin]). A model of depth 1 has nothing to draft with: "adaptive" is plain
    there. The fixed plan's own checks are `SpeculativeConfig`'s (engine/config.py); here only the model's depth."""
    if spec == "off" or (spec == "adaptive" and full_depth < 2):
        return FixedController(0, 0, trace_path)
    if spec == "adaptive":
        assert preset is not None
        return AdaptiveController(preset, full_depth, policy, settings, trace_path)
    k, d, measure, *stop = spec
    if k > 0 and full_depth < 2:
        raise ValueError(
            f"speculation: (k={k}, d={d}): the model runs D={full_depth} loop, nothing to draft with (self-speculation "
            "needs D >= 2); use speculation='off' (or 'adaptive', which decodes plainly there)"
        )
    if k > 0 and not 1 <= d < full_depth:
        raise ValueError(
            f"speculation.d={d}: must be in 1..{full_depth - 1} (the model's full depth is D={full_depth})"
        )
    return FixedController(k, d, trace_path, measure, stop[0] if stop else None)
