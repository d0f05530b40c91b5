"""The goodput policy choosing per-token stopping plans (K, d, θ) (issue 36 item 2; docs/adaptive.md "Per-token
stopping"): the pricing of a stopping round, the margin statistics, and outcome tests on a synthetic workload whose
drafts carry a margin that does, or does not, tell an accepted draft from a rejected one."""

from __future__ import annotations

import math
from collections import Counter

import pytest
from test_policies import preset
from workload import Phase, Workload

from looped_spec.control import AdaptiveController
from looped_spec.control.acceptance import markov_tokens
from looped_spec.control.margins import DraftMargins
from looped_spec.control.passcost import PassCost
from looped_spec.control.plan import RoundFeedback, SpeculationPlan, round_feedback
from looped_spec.control.settings import ControlSettings
from looped_spec.presets.schema import CostConfig
from looped_spec.tuning.derive import ideal_cost

DEPTH = 4
MARGINS = (0.01, 0.1)
HIGH, LOW = 0.5, 0.001  # an informative draft's margin when it will be accepted, and when it will not


class MarginWorkload(Workload):
    """Each draft position agrees with probability α_d; its margin is HIGH when it agrees and LOW when it does not
    (`informative`; a share `flip` of positions the other way round), or uniform on [0, 0.2) whatever it does."""

    def __init__(self, truth: PassCost, informative: bool, flip: float = 0.05, seed: int = 0) -> None:
        super().__init__(truth, noise=0.05, seed=seed)
        self.informative, self.flip = informative, flip

    def margin(self, agrees: bool) -> float:
        if not self.informative:
            return self.rng.random() * 0.2
        sure = agrees != (self.rng.random() < self.flip)
        return HIGH if sure else LOW

    def keep_and_hit(self, alpha: float, theta: float) -> tuple[float, float]:
        """P(margin >= θ) and P(margin >= θ and the draft agrees), the truth."""
        if not self.informative:
            keep = max(0.0, 1.0 - theta / 0.2)
            return keep, keep * alpha
        sure_if_agree, sure_if_not = (1.0 - self.flip, self.flip) if LOW < theta <= HIGH else (1.0, 1.0)
        return alpha * sure_if_agree + (1.0 - alpha) * sure_if_not, alpha * sure_if_agree

    def goodput_of(self, option: tuple[int, int, float | None], phase: Phase) -> float:
        k, d, theta = option
        if theta is None:
            return self.goodput(k, d, phase)
        keep, hit = self.keep_and_hit(phase.alpha[d - 1], theta)
        seconds = float(self.truth.stopping_seconds([k], [d], [keep], phase.batch, phase.context)[0])
        return phase.batch * markov_tokens(hit, 0.0, k) / seconds

    def feedback(self, plan: SpeculationPlan, phase: Phase) -> RoundFeedback:
        if plan.k == 0 or not plan.report_margins:
            return super().feedback(plan, phase)
        rng, alpha = self.rng, phase.alpha[plan.d - 1]
        proposed, accepted, margins = [], [], []
        for _ in range(phase.batch):
            drafted, hits, rejected, row = 0, 0, False, []
            for _ in range(plan.k):
                agrees = rng.random() < alpha
                m = self.margin(agrees)
                row.append(m)
                if plan.stop_margin is not None and m < plan.stop_margin:
                    break
                drafted += 1
                if not rejected and agrees:
                    hits += 1
                else:
                    rejected = True
                    if plan.stop_margin is None:
                        break  # the drafts after the first rejection: their margins tell nothing (never checked)
            proposed.append(drafted)
            accepted.append(hits)
            margins.append(row[: drafted + 1] if drafted < plan.k and plan.stop_margin is not None else row[:drafted])
        keep, _ = self.keep_and_hit(alpha, plan.stop_margin) if plan.stop_margin is not None else (1.0, 0.0)
        seconds = float(self.truth.stopping_seconds([plan.k], [plan.d], [keep], phase.batch, phase.context)[0])
        return round_feedback(plan, batch_size=phase.batch, context=phase.context, num_proposed=proposed,
                              num_accepted=accepted, seconds=seconds * math.exp(rng.gauss(0.0, 0.05)),
                              draft_margins=margins)  # fmt: skip


def controller(margins=MARGINS, **settings) -> AdaptiveController:
    return AdaptiveController(
        preset(alpha=[0.5, 0.7, 0.9, 1.0]), DEPTH, settings=ControlSettings(stop_margins=margins, **settings)
    )


def options(ctl: AdaptiveController) -> list[tuple[int, int, float | None]]:
    policy = ctl.policy
    return [(k, d, policy.stop_margin(o)) for o, (k, d) in enumerate(policy.options)]


def run(workload: MarginWorkload, ctl: AdaptiveController, phase: Phase) -> list[tuple[int, int, float | None]]:
    """The plans of the rounds that were not measured (a measured round drafts every K: its readouts are of the
    plan's own positions)."""
    chosen = []
    for _ in range(phase.rounds):
        plan = ctl.plan(phase.batch, phase.context)
        if not plan.measure_depths:
            chosen.append((plan.k, plan.d, plan.stop_margin))
        ctl.observe(workload.feedback(plan, phase))
    return chosen


@pytest.mark.parametrize(("k", "d", "batch", "context"), [(1, 1, 1, 0.0), (3, 2, 8, 100.0), (5, 1, 32, 300.0)])
def test_a_stopping_round_that_keeps_every_draft_costs_the_plan_and_less_when_it_keeps_fewer(k, d, batch, context):
    cost = PassCost(CostConfig.model_validate(ideal_cost(32)), DEPTH)
    full = cost.profile_seconds([k], [d], batch, context)[0]
    prices = cost.stopping_seconds([k] * 4, [d] * 4, [1.0, 0.8, 0.4, 0.0], batch, context).tolist()
    assert prices[0] == pytest.approx(full, rel=1e-9)
    assert prices == sorted(prices, reverse=True) and prices[-1] < full


def test_margins_count_checked_drafts_and_a_stopped_round_only_for_thresholds_at_or_above_its_own():
    m = DraftMargins(DEPTH, (0.01, 0.1), memory=1e9)
    # a round without stopping: request 0 accepted 2 of 3 (its third draft, the rejection, is checked too); request 1
    # rejected its first (the drafts after it were never checked: their margins do not count)
    m.observe(1, [[0.5, 0.05, 0.005], [0.2, 0.9, 0.9]], [3, 3], [2, 0], None)
    assert m.all[0] == [4.0, 2.0]
    assert m.by_threshold[0] == [[4.0, 3.0, 2.0], [4.0, 2.0, 1.0]]  # seen, sure, sure and accepted
    # a round stopped at 0.1: its proposed draft (accepted) and the draft it stopped at (margin 0.05) count for
    # θ = 0.1 only; the baseline of all drafts is left alone
    m.observe(1, [[0.3, 0.05]], [1], [1], 0.1)
    assert m.all[0] == [4.0, 2.0]
    assert m.by_threshold[0] == [[4.0, 3.0, 2.0], pytest.approx([6.0, 3.0, 2.0])]
    assert m.pass_rate(1, 1) == pytest.approx(0.5)
    assert m.relative_agreement(1, 1) == pytest.approx((2 / 3) / (2 / 4))  # no prior weight here
    # a request whose margins were not reported (a round under early exit) counts for nothing
    m.observe(1, [[]], [2], [1], None)
    assert m.all[0] == [4.0, 2.0]


def test_it_stops_drafts_when_the_margin_tells_accepted_from_rejected_and_it_pays():
    ctl = controller()
    workload = MarginWorkload(ctl.cost, informative=True)
    phase = Phase(1, [0.5, 0.7, 0.9, 1.0], 400)  # the truth: stopping runs 1.25x the best fixed plan here
    chosen = run(workload, ctl, phase)[50:]
    stopping = sum(margin is not None for _, _, margin in chosen) / len(chosen)
    best_fixed = max(workload.goodput_of(o, phase) for o in options(ctl) if o[2] is None)
    achieved = sum(workload.goodput_of(o, phase) for o in chosen) / len(chosen)
    assert stopping > 0.8, Counter(chosen).most_common(5)
    assert achieved > 1.1 * best_fixed, (achieved / best_fixed, Counter(chosen).most_common(5))


@pytest.mark.parametrize("batch", [1, 8, 32])
def test_with_margins_that_tell_nothing_it_does_no_worse_than_without_stopping(batch):
    truth = controller(()).cost
    achieved = {}
    for margins in (MARGINS, ()):
        ctl = controller(margins)
        workload = MarginWorkload(truth, informative=False, seed=batch)
        phase = Phase(batch, [0.5, 0.7, 0.9, 1.0], 300)
        chosen = run(workload, ctl, phase)[50:]
        achieved[margins] = sum(workload.goodput_of(o, phase) for o in chosen) / len(chosen)
    assert achieved[MARGINS] >= 0.97 * achieved[()], achieved


def test_stop_margins_are_checked_and_need_the_goodput_policy():
    with pytest.raises(ValueError, match="stop_margins"):
        ControlSettings(stop_margins=(0.0,))
    with pytest.raises(ValueError, match="stop_margins"):
        ControlSettings(stop_margins=0.1)
    assert ControlSettings(stop_margins=[0.1, 0.01, 0.1]).stop_margins == (0.01, 0.1)  # a list, as JSON gives it
    with pytest.raises(ValueError, match="stop_margins: .* goodput"):
        AdaptiveController(preset(), DEPTH, policy="ema", settings=ControlSettings(stop_margins=(0.1,)))


def test_plans_ask_for_margins_only_when_stopping_may_be_chosen_and_measured_rounds_never_stop():
    plain = AdaptiveController(preset(alpha=[0.9, 0.95, 0.97, 1.0]), DEPTH)
    assert not any(plain.plan(8, 100.0).report_margins for _ in range(50))
    ctl = controller()
    workload = MarginWorkload(ctl.cost, informative=True)
    phase = Phase(8, [0.5, 0.7, 0.9, 1.0], 1)
    for _ in range(300):
        plan = ctl.plan(8, 100.0)
        assert plan.report_margins == (plan.k > 0 and not plan.measure_depths)
        assert plan.stop_margin is None or not plan.measure_depths
        ctl.observe(workload.feedback(plan, phase))


@pytest.mark.parametrize(("k", "d", "batch"), [(3, 1, 1), (5, 2, 8), (2, 3, 32)])
def test_a_round_whose_every_first_draft_is_unsure_is_one_draft_step_and_one_position_verified(k, d, batch):
    """keep = 0: draft step 0 (d passes and a readout over the batch), then a verification of each request's first
    position only (D - d passes over B positions, at the round's context)."""
    cost = PassCost(CostConfig.model_validate(ideal_cost(32)), DEPTH)
    b, context = batch, 64.0
    draft = cost.step_features(b, b, 1.0)[0] + d * cost.pass_features(b, b, context)[0] + cost.readout_features(b)[0]
    verify = cost.step_features(b, b, 0.0)[0] + (DEPTH - d) * cost.pass_features(b, b, context)[0]
    verify = verify + cost.readout_features(b)[0]
    outside = cost.outside_features([1e-9], b)[0]
    want = float((draft + verify + outside) @ cost.theta)
    assert cost.stopping_seconds([k], [d], [0.0], b, context)[0] == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("batch", [1, 8])
def test_adaptive_choosing_stopping_plans_on_a_shipped_model_equals_plain_decoding(tmp_path, batch):
    """tiny-ouro on code prompts, where the controller does choose stopping plans (the trace shows which ran):
    greedy output equals plain decoding's, and no KV block stays in use."""
    import json

    from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
    from looped_spec.tuning.prompt_sets import prompt_group

    adapter = load_adapter("tiny-ouro", dtype="float32", device="cpu")
    prompts = prompt_group("code", 2 * batch if batch > 1 else 6)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    trace = tmp_path / "trace.jsonl"
    engine = LoopedSpecEngine(adapter, max_batch_size=8, control={"stop_margins": [0.003, 0.01, 0.03]},
                              trace_path=str(trace))  # fmt: skip
    plain = LoopedSpecEngine(adapter, speculation="off", max_batch_size=8)
    for i in range(0, len(prompts), batch):
        group = prompts[i : i + batch]
        assert [o.token_ids for o in engine.generate(group, params)] == [
            o.token_ids for o in plain.generate(group, params)
        ]
    assert engine.num_free_blocks == engine.kv.num_blocks
    engine.controller.close()
    plans = [json.loads(line) for line in trace.read_text().splitlines()]
    assert any(p["event"] == "plan" and p["stop_margin"] is not None for p in plans)


def test_stopping_options_priced_together_price_like_each_alone():
    cost = PassCost(CostConfig.model_validate(ideal_cost(32)), DEPTH)
    ks, ds, keeps = [1, 5, 3, 2], [1, 2, 3, 1], [0.9, 0.63, 0.2, 1.0]
    together = cost.stopping_seconds(ks, ds, keeps, 8, 130.0)
    alone = [cost.stopping_seconds([k], [d], [x], 8, 130.0)[0] for k, d, x in zip(ks, ds, keeps)]
    assert together.tolist() == pytest.approx(alone, rel=1e-12)


def test_on_loop_passes_the_drafts_report_their_margins_and_stopping_plans_stay_lossless(tmp_path):
    """batching="loop": the rounds' drafts report their margins (the controller learns s_θ and a_θ there too and
    chooses stopping plans), and greedy output equals plain decoding's."""
    import json

    from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
    from looped_spec.tuning.prompt_sets import prompt_group

    adapter = load_adapter("tiny-ouro", dtype="float32", device="cpu")
    prompts = prompt_group("code", 12)
    params = SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True)
    trace = tmp_path / "trace.jsonl"
    engine = LoopedSpecEngine(adapter, max_batch_size=8, batching="loop", trace_path=str(trace),
                              control={"stop_margins": [0.003, 0.01, 0.03]})  # fmt: skip
    plain = LoopedSpecEngine(adapter, speculation="off", max_batch_size=8)
    for group in [prompts[i : i + 1] for i in range(6)] + [prompts[6:]]:
        assert [o.token_ids for o in engine.generate(group, params)] == [
            o.token_ids for o in plain.generate(group, params)
        ]
    assert engine.num_free_blocks == engine.kv.num_blocks
    assert engine.controller.margins.evidence(1) > 0
    engine.controller.close()
    plans = [json.loads(line) for line in trace.read_text().splitlines()]
    reported = [p for p in plans if p["event"] == "feedback" and p["draft_margins"]]
    assert reported and all(len(m) >= k for p in reported for m, k in zip(p["draft_margins"], p["num_proposed"]))
    assert any(p["event"] == "plan" and p["stop_margin"] is not None for p in plans)
