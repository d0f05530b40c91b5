"""The controllers (control/controller.py) and what they hand out and learn: plans (plan.py), buckets (buckets.py),
the readout budget, the JSONL trace (trace.py), the settings and the stats.

Outcome and invariant tests on a synthetic workload (tests/workload.py); the policies' choices are judged in
test_policies.py.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
from pathlib import Path

import pytest
from conftest import make_engine
from workload import Phase, Workload

from looped_spec.control import AdaptiveController, ControlSettings, FixedController
from looped_spec.control.controller import make_controller
from looped_spec.control.passcost import PRICE_PRIOR, PassCost
from looped_spec.control.plan import SpeculationPlan, round_feedback
from looped_spec.presets import AdaptiveSpecConfig
from looped_spec.tuning.derive import ideal_cost

DEPTH = 4
TUNE = [0.61, 0.79, 0.92, 1.0]
CODE = [0.88, 0.94, 0.97, 1.0]
HARD = [0.30, 0.45, 0.70, 1.0]
RANDOM = [0.02, 0.03, 0.05, 1.0]
# bucket 0 has no plain candidate (disable.enabled adds plain as candidate -1); the others list plain first
CANDIDATES = [[[1, 1], [2, 1], [4, 2]], [[0, 0], [2, 1], [3, 2]], [[0, 0], [1, 1], [2, 3]]]
RANGES = [(1, 2), (3, 12), (13, None)]


def preset(enabled: bool = True, depth: int = DEPTH) -> AdaptiveSpecConfig:
    return AdaptiveSpecConfig.parse(
        {
            "model": "synthetic",
            "full_depth": depth,
            "buckets": [
                {"min_batch": lo, "max_batch": hi, "candidates": c, "theta_up": 0.8, "theta_down": 0.4}
                for (lo, hi), c in zip(RANGES, CANDIDATES)
            ],
            "disable": {"enabled": enabled},
            "acceptance": {"alpha": TUNE, "rho": [0.0] * DEPTH, "positions": 1000},
            "cost": ideal_cost(32),
        }
    )


def key(k: int, d: int) -> tuple[int, int]:
    return (k, d if k else 0)


def check_plan(plan: SpeculationPlan, batch: int, enabled: bool, policy: str, stickiness: float = 1.25) -> None:
    """The invariants of one adaptive plan at batch size `batch`."""
    lo, hi = RANGES[plan.bucket]
    # the bucket's range, widened by the stickiness (and one batch size) for a batch hovering at its edge
    assert min(lo - 1, lo / stickiness) <= batch <= (math.inf if hi is None else max(hi + 1, hi * stickiness))
    own = [key(k, d) for k, d in CANDIDATES[plan.bucket]]
    everything = {key(k, d) for c in CANDIDATES for k, d in c} | ({(0, 0)} if enabled else set())
    assert key(plan.k, plan.d) in everything  # never a plan the preset does not list
    if plan.candidate >= 0:
        assert key(plan.k, plan.d) == own[plan.candidate]
    else:
        assert plan.candidate == -1
        assert key(plan.k, plan.d) not in own  # a plan of the bucket's list always says which candidate it is
        if plan.k > 0:
            assert policy == "goodput"  # goodput prices every bucket's options in every bucket
        # else plain in a bucket whose list has no K = 0 (disable.enabled: see test_disable_off_keeps_...)


@pytest.mark.parametrize("policy", ["goodput", "ema"])
@pytest.mark.parametrize("enabled", [True, False])
def test_plans_are_numbered_and_always_an_option_of_the_preset(policy, enabled):
    rng = random.Random(7)
    controller = AdaptiveController(preset(enabled), DEPTH, policy=policy)
    workload = Workload(PassCost(preset().cost, DEPTH), noise=0.1, seed=3)
    batches = [b for b in range(1, 101) for _ in range(3)]
    rng.shuffle(batches)
    seen = set()
    for i, batch in enumerate(batches):
        alpha = (CODE, HARD, RANDOM)[(i // 60) % 3]  # easy and hard text: speculation on and off
        plan = controller.plan(batch, 150.0)
        assert plan.plan_id == i
        check_plan(plan, batch, enabled, policy)
        seen.add((plan.bucket, plan.k))
        controller.observe(workload.feedback(plan, Phase(batch, alpha, 1, 150.0)))
    assert {b for b, _ in seen} == {0, 1, 2}
    assert any(k == 0 for _, k in seen) and any(k > 0 for _, k in seen)


@pytest.mark.parametrize("policy", ["goodput", "ema"])
def test_disable_off_keeps_speculation_on_in_a_bucket_without_plain(policy):
    """disable.enabled = false: a bucket whose candidates have no K = 0 never switches speculation off, even on text
    where nothing pays (the other buckets list plain decoding and do switch off)."""
    controller = AdaptiveController(preset(enabled=False), DEPTH, policy=policy)
    workload = Workload(PassCost(preset().cost, DEPTH), noise=0.1, seed=5)
    small, large = workload.run(controller, [Phase(1, RANDOM, 150), Phase(8, RANDOM, 150)])
    assert any(k == 0 for k, _ in large[50:])  # plain where the list has it ...
    assert all(k > 0 for k, _ in small), sorted(set(small))  # ... never where it has not


@pytest.mark.parametrize("policy", ["goodput", "ema"])
def test_a_fresh_controller_takes_the_bucket_of_the_batch_size(policy):
    for batch in range(1, 101):
        plan = AdaptiveController(preset(), DEPTH, policy=policy).plan(batch, 0.0)
        lo, hi = RANGES[plan.bucket]
        assert lo <= batch <= (hi or math.inf), (batch, plan.bucket)
        check_plan(plan, batch, True, policy)


def test_bucket_stickiness_keeps_a_batch_near_the_edge_and_lets_a_far_one_move():
    controller = AdaptiveController(preset(), DEPTH)
    walk = [(8, 1), (13, 1), (15, 1), (16, 2), (11, 2), (12, 2), (10, 1), (100, 2), (2, 0), (3, 0), (4, 1), (1, 0)]
    assert [(b, controller.plan(b, 0.0).bucket) for b, _ in walk] == walk
    strict = AdaptiveController(preset(), DEPTH, settings=ControlSettings(bucket_stickiness=1.0))
    walk = [(8, 1), (13, 1), (14, 2), (12, 2), (11, 1)]  # the range and one batch size either side
    assert [(b, strict.plan(b, 0.0).bucket) for b, _ in walk] == walk


# --------------------------------------------------------------------------- feedback


def plan_of(controller: AdaptiveController, k: int, d: int, batch: int, measure: bool = False) -> SpeculationPlan:
    """A plan as the controller would number it, with a chosen (k, d)."""
    plan = controller.plan(batch, 100.0)
    return SpeculationPlan(plan.plan_id, k, d, plan.bucket, plan.candidate, measure)


def test_a_measured_round_updates_the_acceptance_of_every_depth():
    controller = AdaptiveController(preset(), DEPTH)
    before = list(controller.acceptance.alpha)
    plan = plan_of(controller, 0, 0, 4, measure=True)
    fb = round_feedback(
        plan, batch_size=4, context=100.0, num_proposed=[0] * 4, num_accepted=[0] * 4, seconds=0.0,
        depth_matches=[0, 0, 4, 4], depth_trials=[4] * DEPTH,
    )  # fmt: skip
    controller.observe(fb)
    after = list(controller.acceptance.alpha)
    assert after[0] < before[0] and after[1] < before[1] and after[2] > before[2] and after[3] == 1.0
    assert controller.acceptance.positions == 4


def test_an_unmeasured_speculative_round_updates_only_its_own_depth():
    controller = AdaptiveController(preset(), DEPTH)
    before = list(controller.acceptance.alpha)
    plan = plan_of(controller, 3, 2, 4)
    fb = round_feedback(plan, batch_size=4, context=100.0, num_proposed=[3] * 4, num_accepted=[3] * 4, seconds=0.0)
    controller.observe(fb)
    after = list(controller.acceptance.alpha)
    assert after[1] > before[1]
    assert after[0] == before[0] and after[2] == before[2]
    rejected = round_feedback(
        plan_of(controller, 2, 1, 4), batch_size=4, context=100.0, num_proposed=[2] * 4, num_accepted=[0] * 4,
        seconds=0.0,
    )  # fmt: skip
    controller.observe(rejected)
    assert controller.acceptance.alpha[0] < before[0] and controller.acceptance.alpha[1] == after[1]
    # a plain round, and a speculative round under early exit (free exits are no evidence), teach nothing
    frozen = list(controller.acceptance.alpha)
    controller.observe(
        round_feedback(plan_of(controller, 0, 0, 4), batch_size=4, context=100.0, num_proposed=[0] * 4,
                       num_accepted=[0] * 4, seconds=0.0)
    )  # fmt: skip
    controller.observe(
        round_feedback(plan_of(controller, 2, 1, 4), batch_size=4, context=100.0, num_proposed=[2] * 4,
                       num_accepted=[0] * 4, seconds=0.0, exit_depths=[1, 2, 4, 4])
    )  # fmt: skip
    assert list(controller.acceptance.alpha) == frozen


def preset_drafting_at(depths: list[int]) -> AdaptiveSpecConfig:
    """`preset()` with every candidate's draft depth the nearest of `depths` (plain stays plain)."""
    config = preset().model_dump()
    for bucket in config["buckets"]:
        for c in bucket["candidates"]:
            c["d"] = min(depths, key=lambda d, c=c: abs(d - c["d"])) if c["k"] else 0
    return AdaptiveSpecConfig.parse(config)


def test_measured_rounds_read_out_the_options_draft_depths_only():
    """Either policy reads the agreement at its options' draft depths only: those are what a measured round reads
    out (the engine's runner is given them) and what its readouts are priced by."""
    controller = AdaptiveController(preset_drafting_at([1, 3]), DEPTH)
    assert controller.readout_depths() == [1, 3] and controller.cost.readout_depths == {1, 3}
    assert AdaptiveController(preset(), DEPTH).readout_depths() == [1, 2, 3]
    # the EMA policy's readouts serve its probes, of each bucket's most conservative speculative candidate
    ema = AdaptiveController(preset(), DEPTH, policy="ema")
    assert ema.readout_depths() == sorted({b.ds[b.lowest_spec] for b in ema.buckets}) == [1]
    assert FixedController(2, 1, measure_depths=True).readout_depths() is None  # every depth: the tuner's readouts
    engine = make_engine("huginn", speculation="adaptive")
    assert engine.runner.readout_depths == set(engine.controller.readout_depths()) != set(range(1, 8))
    # a round whose readouts skipped depth 2 teaches nothing there, overall or per request
    before, own_before = list(controller.acceptance.alpha), controller.acceptance.batch_alpha()
    plan = plan_of(controller, 0, 0, 2, measure=True)
    controller.observe(round_feedback(
        plan, batch_size=2, context=100.0, num_proposed=[0, 0], num_accepted=[0, 0], seconds=0.0,
        depth_matches=[0, 0, 0, 2], depth_trials=[2, 0, 2, 2], request_ids=["a", "b"],
        request_matches=[[0, 0, 0, 1], [0, 0, 0, 1]], request_trials=[1, 1],
    ))  # fmt: skip
    controller.acceptance.set_batch(["a", "b"])
    after, own_after = controller.acceptance.alpha, controller.acceptance.batch_alpha()
    assert after[0] < before[0] and after[1] == before[1] and after[2] < before[2]
    assert own_after[0] < own_before[0] and own_after[1] == pytest.approx(before[1]) and own_after[2] < own_before[2]


@pytest.mark.parametrize("policy", ["goodput", "ema"])
def test_a_speculative_round_is_not_measured_when_its_drafts_report_every_depth_read(policy):
    """With every option drafting at one depth, a speculative round's readouts would be its drafts' outcomes (which it
    reports anyway): only plain rounds read out, and the estimate still follows the text."""
    controller = AdaptiveController(preset_drafting_at([1]), DEPTH, policy=policy)
    assert controller.readout_depths() == [1]
    workload = Workload(PassCost(preset().cost, DEPTH), noise=0.02, seed=3)
    rounds, measured = {True: 0, False: 0}, {True: 0, False: 0}
    for phase in [Phase(4, RANDOM, 300), Phase(4, CODE, 300)]:
        for _ in range(phase.rounds):
            plan = controller.plan(phase.batch, phase.context)
            rounds[plan.k > 0] += 1
            measured[plan.k > 0] += plan.measure_depths
            controller.observe(workload.feedback(plan, phase))
    assert rounds[True] > 200 and measured[True] == 0 and measured[False] > 10
    assert controller.acceptance.alpha[0] == pytest.approx(CODE[0], abs=0.1)


def test_the_measure_share_is_learned_beside_ordinary_rounds_free_of_the_drift():
    controller = AdaptiveController(preset(), DEPTH)
    cost = controller.cost
    plan = plan_of(controller, 2, 1, 8)
    profile = cost.seconds(2, 1, 8, 100.0)
    kwargs = dict(batch_size=8, context=100.0, num_proposed=[2] * 8, num_accepted=[1] * 8)
    readouts = dict(depth_matches=[4, 8, 12, 12], depth_trials=[12] * 4)
    # a measured round alone teaches nothing: what measuring adds is read against an ordinary round next to it
    before = cost.measure_share(2, 1, 8, 100.0)
    assert before < 0.05
    controller.observe(round_feedback(plan, seconds=1.2 * profile, **kwargs, **readouts))
    assert cost.drift == pytest.approx(1.0) and cost.measure_share(2, 1, 8, 100.0) == before
    # an ordinary round at 3x the profile (a machine far from the profile's, the drift factor not there yet), then a
    # measured one at 3.6x: measuring adds 20 %, whatever the drift factor believes
    controller.observe(round_feedback(plan_of(controller, 2, 1, 8), seconds=3.0 * profile, **kwargs))
    drift = cost.drift
    assert 1.0 < drift < 1.1
    controller.observe(round_feedback(plan_of(controller, 2, 1, 8), seconds=3.6 * profile, **kwargs, **readouts))
    assert cost.drift == drift
    assert cost.measure_share(2, 1, 8, 100.0) == pytest.approx(0.2)
    # not beside a round of another plan (the profile's error between plans is not what measuring adds)
    controller.observe(round_feedback(plan_of(controller, 3, 1, 8), seconds=profile, **kwargs))
    controller.observe(round_feedback(plan_of(controller, 2, 1, 8), seconds=9.0 * profile, **kwargs, **readouts))
    assert cost.measure_share(2, 1, 8, 100.0) == pytest.approx(0.2)


def test_a_round_that_drafted_nothing_is_priced_as_plain_and_ordinary_rounds_move_the_drift():
    controller = AdaptiveController(preset(), DEPTH)
    cost = controller.cost
    profile = cost.seconds(2, 1, 8, 100.0)
    kwargs = dict(batch_size=8, context=100.0, num_proposed=[2] * 8, num_accepted=[1] * 8)
    # a round whose requests drafted nothing ran as plain decoding, and is priced as such
    plain = cost.seconds(0, 0, 8, 100.0)
    nothing = dict(kwargs, num_proposed=[0] * 8, num_accepted=[0] * 8)
    controller.observe(round_feedback(plan_of(controller, 2, 1, 8), seconds=plain, **nothing))
    assert cost.drift == pytest.approx(1.0)
    for _ in range(5):
        controller.observe(round_feedback(plan_of(controller, 2, 1, 8), seconds=3.0 * profile, **kwargs))
    assert 1.0 < cost.drift < 3.0
    assert cost.predict(2, 1, 8, 100.0) == pytest.approx(cost.drift * profile)


# --------------------------------------------------------------------------- the readout budget


def readout_cost(policy: str, budget: float, overhead: float, speed: float = 1.0) -> tuple[float, int]:
    """What measured rounds cost, as a share of the decode time, over 3,000 rounds of a synthetic workload on a machine
    `speed` times the preset profile's time (the profile's relative prices right); and how many rounds measured. The
    EMA policy reads out only while speculation is off: it runs text where nothing pays."""
    controller = AdaptiveController(preset(), DEPTH, policy=policy, settings=ControlSettings(readout_budget=budget))
    truth = PassCost(preset().cost, DEPTH)
    truth.theta = truth.theta * speed
    workload = Workload(truth, noise=0.05, seed=1, measure_overhead=overhead)
    extra, total, measured = 0.0, 0.0, 0
    texts = (CODE, HARD) if policy == "goodput" else (RANDOM, RANDOM)
    for i in range(3000):
        phase = Phase(8, texts[(i // 500) % 2], 1, 200.0)
        plan = controller.plan(phase.batch, phase.context)
        seconds = workload.seconds(plan.k, plan.d, phase.batch, phase.context)
        total += seconds
        if plan.measure_depths:
            extra += overhead * seconds + truth.measure_seconds(plan.k, plan.d, phase.batch)
            measured += 1
        controller.observe(workload.feedback(plan, phase))
    return extra / total, measured


@pytest.mark.parametrize("overhead", [0.0, 0.15])
@pytest.mark.parametrize("budget", [0.01, 0.003])
@pytest.mark.parametrize("policy", ["goodput", "ema"])
def test_measured_rounds_cost_about_the_readout_budget(budget, policy, overhead):
    """Also when a measured round costs more than the profile's readouts (`overhead`: a share of the round that the
    profile does not see, as the agreement bookkeeping on a CPU): the controller learns it from measured rounds."""
    share, measured = readout_cost(policy, budget, overhead)
    assert 10 <= measured <= 3000 // 2
    # up to 1.2: the price probes' plain rounds, cheaper than the plan's, are part of the total (1.095 without them),
    # and the first measured pair has no ordinary round before it to price measuring against, so the next pair comes
    # at the profile's readout price (at budget 0.003, ~50 measured rounds in all, one pair more is +4 %: 1.16)
    assert 0.5 * budget <= share <= 1.2 * budget, (share, measured)


def test_a_large_batch_reads_out_its_position_target_not_the_whole_budget():
    """A measured round reads out about one position a request: at B = 256 one in ~64 rounds gives the estimate its
    `readout_positions` (4) positions a round, at a small share of the budget (the mutation check, the budget alone
    setting the pace: a measured round every few rounds, ~the whole budget)."""
    budget = 0.03
    controller = AdaptiveController(preset(), DEPTH, settings=ControlSettings(readout_budget=budget))
    truth = PassCost(preset().cost, DEPTH)
    workload = Workload(truth, noise=0.05, seed=1)
    extra = total = 0.0
    for i in range(640):
        phase = Phase(256, (CODE, HARD)[i // 320], 1, 200.0)
        plan = controller.plan(phase.batch, phase.context)
        seconds = workload.seconds(plan.k, plan.d, phase.batch, phase.context)
        total += seconds
        if plan.measure_depths:
            extra += truth.measure_seconds(plan.k, plan.d, phase.batch)
        controller.observe(workload.feedback(plan, phase))
    assert extra / total <= 0.2 * budget, extra / total


def test_the_ema_policy_reads_out_only_while_speculation_is_off():
    """The EMA policy moves on its rounds' own acceptance while it speculates; readouts serve only its probes while a
    bucket is off, so only then does a round read out."""
    controller = AdaptiveController(preset(), DEPTH, policy="ema")
    workload = Workload(PassCost(preset().cost, DEPTH), noise=0.02, seed=5)
    seen = {True: [0, 0], False: [0, 0]}  # bucket off -> [rounds, measured]
    for phase in [Phase(8, CODE, 300), Phase(8, RANDOM, 600), Phase(8, CODE, 300)]:
        for _ in range(phase.rounds):
            plan = controller.plan(phase.batch, phase.context)
            off = controller.policy.states[plan.bucket].off
            seen[off][0] += 1
            seen[off][1] += plan.measure_depths
            controller.observe(workload.feedback(plan, phase))
    assert seen[False][0] > 300 and seen[False][1] == 0
    assert seen[True][0] > 100 and seen[True][1] > 10


@pytest.mark.parametrize("speed", [0.4, 2.5])
@pytest.mark.parametrize("policy", ["goodput", "ema"])
def test_the_readout_budget_holds_on_a_machine_faster_or_slower_than_the_profiles(policy, speed):
    """The drift factor takes ~100 rounds to reach such a machine. Measured against it, what measuring adds was
    learned wrong for hundreds of rounds (2x the budget spent at 0.5x, half of it at 2x); read against the ordinary
    round next to each measured one it is the same at every speed."""
    share, measured = readout_cost(policy, 0.01, 0.15, speed)
    same, _ = readout_cost(policy, 0.01, 0.15)
    assert share == pytest.approx(same, rel=0.05), (share, same, measured)
    assert 0.5 * 0.01 <= share <= 1.2 * 0.01


def test_readouts_cost_less_the_further_speculation_is_from_paying():
    """goodput: while plain decoding runs and the best speculative plan is predicted at r of plain's rate, the readouts
    may cost `readout_budget` × r² (they are worth what they may change); where speculation pays, the whole budget."""

    def readout_share(alpha) -> tuple[float, float]:
        budget = 0.01
        controller = AdaptiveController(preset(), DEPTH, settings=ControlSettings(readout_budget=budget))
        truth = PassCost(preset().cost, DEPTH)
        workload = Workload(truth, noise=0.0, seed=1)
        extra = total = 0.0
        for _ in range(2000):
            phase = Phase(8, alpha, 1, 200.0)
            plan = controller.plan(phase.batch, phase.context)
            seconds = workload.seconds(plan.k, plan.d, phase.batch, phase.context)
            total += seconds
            extra += truth.measure_seconds(plan.k, plan.d, phase.batch) if plan.measure_depths else 0.0
            controller.observe(workload.feedback(plan, phase))
        return extra / total / budget, controller.policy.outlook(controller._bucket)

    never_pays, outlook = readout_share(RANDOM)
    pays, speculating = readout_share(CODE)
    assert outlook < 0.8 and speculating == 1.0
    assert 0.5 * outlook**2 <= never_pays <= 1.1 * outlook**2
    assert 0.5 <= pays <= 1.1


# --------------------------------------------------------------------------- fixed plans, construction errors


def test_fixed_controller_always_returns_its_plan():
    fixed = FixedController(3, 2, measure_depths=True)
    plans = [fixed.plan(b, 10.0 * b) for b in (1, 5, 64, 2)]
    assert [p.plan_id for p in plans] == [0, 1, 2, 3]
    assert {(p.k, p.d, p.bucket, p.candidate, p.measure_depths) for p in plans} == {(3, 2, -1, -1, True)}
    assert fixed.plan_shapes() == [(0, 0), (3, 2)]
    plain = FixedController(0, 5)
    assert (plain.plan(4, 0.0).k, plain.plan(4, 0.0).d, plain.plan(4, 0.0).measure_depths) == (0, 0, False)
    with pytest.raises(ValueError, match="k=-1"):
        FixedController(-1, 0)
    with pytest.raises(ValueError, match="d=0"):
        FixedController(2, 0)
    # per-token stopping needs drafts, and every draft of a measured round (SpeculativeConfig refuses both too)
    for k, measure in ((2, True), (0, False)):
        with pytest.raises(ValueError, match="stop_margin=0.5: needs k > 0 and no measure_depths"):
            FixedController(k, 1, measure_depths=measure, stop_margin=0.5)
    assert FixedController(2, 1, stop_margin=0.5).plan(1, 10.0).stop_margin == 0.5


def test_make_controller_checks_the_draft_depth_against_the_model():
    for d in (4, 7, 0):
        with pytest.raises(ValueError, match=f"speculation.d={d}") as err:
            make_controller((2, d, False), 4, None)
        assert "D=4" in str(err.value)
    fixed = make_controller((2, 3, True), 4, None)
    assert (fixed.k, fixed.d, fixed.measure_depths) == (2, 3, True)
    assert make_controller((0, 0, False), 4, None).k == 0
    assert type(make_controller("off", 4, preset())) is FixedController
    assert type(make_controller("adaptive", 1, None)) is FixedController  # nothing to draft with at depth 1
    with pytest.raises(ValueError, match=r"the model runs D=1 loop, nothing to draft with"):
        make_controller((2, 1, False), 1, None)
    assert isinstance(make_controller("adaptive", 4, preset(), policy="ema"), AdaptiveController)


def test_adaptive_controller_refuses_a_preset_of_another_depth_and_an_unknown_policy():
    with pytest.raises(ValueError, match="the preset is for depth 4, the model has 8"):
        AdaptiveController(preset(), 8)
    with pytest.raises(ValueError, match="policy='fastest'") as err:
        AdaptiveController(preset(), DEPTH, policy="fastest")
    assert "goodput" in str(err.value) and "ema" in str(err.value)
    fitted, _ = preset().for_depth(8)
    assert AdaptiveController(fitted, 8).plan(4, 0.0).d < 8


# --------------------------------------------------------------------------- the trace


@pytest.mark.parametrize("policy", ["goodput", "ema"])
def test_the_trace_has_every_plan_feedback_and_decision(policy, tmp_path):
    path = tmp_path / "sub" / "trace.jsonl"
    controller = AdaptiveController(preset(), DEPTH, policy=policy, trace_path=path)
    workload = Workload(PassCost(preset().cost, DEPTH), noise=0.1, seed=2)
    phases = [Phase(6, RANDOM, 120), Phase(6, CODE, 120), Phase(1, CODE, 40), Phase(30, HARD, 40)]
    workload.run(controller, phases)
    controller.close()
    controller.close()  # safe twice
    controller.plan(6, 0.0)  # and planning after close writes nothing
    events = [json.loads(line) for line in path.read_text().splitlines()]
    plans = [e for e in events if e["event"] == "plan"]
    feedback = [e for e in events if e["event"] == "feedback"]
    decisions = [e for e in events if e["event"] == "decision"]
    assert [p["plan_id"] for p in plans] == list(range(320))
    assert [f["plan_id"] for f in feedback] == list(range(320))
    assert all(isinstance(e["t"], float) for e in events)
    assert {"k", "d", "bucket", "candidate", "measure_depths", "batch", "context"} <= set(plans[0])
    assert {"num_proposed", "num_accepted", "seconds", "batch_size"} <= set(feedback[0])
    # every time a bucket's plan changes, a decision of that bucket was written since its previous plan
    switches = 0
    last: dict[int, dict] = {}
    for p in plans:
        before = last.get(p["bucket"])
        if before is not None and (p["k"], p["d"]) != (before["k"], before["d"]):
            switches += 1
            assert any(
                e["bucket"] == p["bucket"] and before["plan_id"] <= e["plan_id"] <= p["plan_id"] and e["what"]
                for e in decisions
            ), (before, p)
        last[p["bucket"]] = p
    probes = sum("price probe" in e["what"] for e in decisions)  # one decision, two switches: to plain and back
    assert switches >= 2 and len(decisions) + probes >= switches


@pytest.mark.parametrize("policy", ["goodput", "ema"])
def test_each_decision_is_traced_once(policy, tmp_path):
    path = tmp_path / "trace.jsonl"
    controller = AdaptiveController(preset(), DEPTH, policy=policy, trace_path=path)
    Workload(PassCost(preset().cost, DEPTH), noise=0.1, seed=2).run(controller, [Phase(6, RANDOM, 120)])
    controller.close()
    decisions = [json.loads(line) for line in path.read_text().splitlines() if '"decision"' in line]
    assert decisions
    keys = [(e["bucket"], e["plan_id"], e["what"]) for e in decisions]
    assert len(keys) == len(set(keys)), keys


def test_a_fixed_controller_traces_plans_and_feedback(tmp_path):
    path = tmp_path / "fixed.jsonl"
    fixed = FixedController(2, 1, trace_path=path)
    for _ in range(3):
        plan = fixed.plan(2, 17.126)
        fixed.observe(
            round_feedback(plan, batch_size=2, context=17.126, num_proposed=[2, 2], num_accepted=[1, 2], seconds=0.1)
        )
    fixed.close()
    fixed.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    assert [e["event"] for e in events] == ["plan", "feedback"] * 3
    assert events[0]["context"] == 17.13 and events[1]["num_accepted"] == [1, 2]


def test_a_trace_path_that_cannot_be_written_is_an_error_naming_it(tmp_path):
    """A directory, or a folder under a file: a ValueError naming `trace_path` and why (it was the bare OSError, which
    the engine and the command line passed on without saying which option it came from)."""
    (tmp_path / "file.txt").write_text("")
    for path, why in ((tmp_path, "Is a directory"), (tmp_path / "file.txt" / "t.jsonl", "File exists")):
        with pytest.raises(ValueError, match=f"trace_path='{path}': cannot write the trace there \\({why}\\)"):
            FixedController(0, 0, trace_path=path)
    with pytest.raises(ValueError, match="trace_path="):
        make_engine("ouro", speculation="adaptive", trace_path=tmp_path)


# --------------------------------------------------------------------------- settings and stats


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("decision_interval", 0, "decision_interval=0"),
        ("decision_interval", 2.5, "decision_interval=2.5"),
        ("hysteresis", 1.0, "hysteresis=1.0"),
        ("plain_margin", -0.1, "plain_margin=-0.1"),
        ("readout_budget", 0.0, "readout_budget=0.0"),
        ("bucket_stickiness", 0.5, "bucket_stickiness=0.5"),
        ("readout_positions", 0.0, "readout_positions=0.0"),
        ("prior_share", -1.0, "prior_share=-1.0"),
        ("acceptance_memory", 0.0, "acceptance_memory=0.0"),
        ("drift_rounds", True, "drift_rounds=True"),
        ("request_memory", "8", "request_memory='8'"),
    ],
)
def test_control_settings_reject_bad_values_naming_the_field(field, value, message):
    with pytest.raises(ValueError, match=message.replace(".", r"\.")):
        ControlSettings(**{field: value})


def test_control_settings_accept_their_range():
    s = ControlSettings(
        readout_positions=0.5, readout_budget=1.0, hysteresis=0.0, prior_share=0.0, bucket_stickiness=1.0
    )
    assert s.readout_positions == 0.5 and s.readout_budget == 1.0


def test_the_engine_takes_control_as_a_dict_of_its_fields():
    engine = make_engine("ouro", speculation="adaptive", control={"readout_budget": 0.2, "readout_positions": 2.0})
    assert engine.controller.settings.readout_budget == 0.2 and engine.controller.settings.readout_positions == 2.0
    with pytest.raises(ValueError, match="control") as err:
        make_engine("ouro", speculation="adaptive", control={"readout_budgt": 0.2})
    assert "readout_budgt" in str(err.value) and "readout_budget" in str(err.value)
    with pytest.raises(ValueError, match="hysteresis=2.0"):
        make_engine("ouro", speculation="adaptive", control={"hysteresis": 2.0})
    with pytest.raises(ValueError, match="control"):
        make_engine("ouro", speculation="adaptive", control=[("hysteresis", 0.1)])


def test_prior_share_weighs_both_priors_and_one_memory_serves_agreement_and_exits():
    """The preset's α counts as prior_share × acceptance_memory positions, the overall estimate in a request's own as
    prior_share × request_memory; the exit-depth histogram remembers acceptance_memory tokens."""
    for share, memory, request_memory in ((0.125, 128.0, 16.0), (0.5, 64.0, 8.0), (0.0, 32.0, 4.0)):
        settings = ControlSettings(prior_share=share, acceptance_memory=memory, request_memory=request_memory)
        ctl = AdaptiveController(preset(), DEPTH, settings=settings)
        assert ctl.acceptance.trials == [share * memory] * DEPTH
        assert ctl.acceptance.request_prior == share * request_memory
        assert ctl.acceptance.memory == ctl.exits.memory == memory


def test_stats_report_the_estimates_and_every_bucket():
    controller = AdaptiveController(preset(), DEPTH)
    workload = Workload(PassCost(preset().cost, DEPTH), noise=0.0, seed=4)
    workload.run(controller, [Phase(8, HARD, 60), Phase(1, CODE, 30)])
    for _ in range(50):  # a machine twice as slow as the profile
        plan = controller.plan(8, 120.0)
        fb = workload.feedback(plan, Phase(8, HARD, 1))
        fb.seconds *= 2.0
        controller.observe(fb)
    stats = controller.stats()
    assert stats["controller"] == "adaptive" and stats["policy"] == "goodput" and stats["model"] == "synthetic"
    assert stats["plans"] == stats["observed"] == 140
    assert stats["alpha"] == pytest.approx(list(controller.acceptance.alpha), abs=1e-4)
    assert stats["alpha"][0] < TUNE[0]  # the hard text's readouts pulled depth 1 down
    assert stats["readout_depths"] == [1, 2, 3]
    assert stats["batch_alpha"] == stats["alpha"]  # a caller that names no requests: the overall estimate
    controller.acceptance.set_batch(["a"])
    controller.acceptance.observe_request_readouts(["a"], [[0, 0, 0, 1]], [1])
    assert controller.stats()["batch_alpha"][0] < stats["alpha"][0]
    assert stats["acceptance_positions"] == controller.acceptance.positions > 0
    assert stats["cost_drift"] == pytest.approx(controller.cost.drift, abs=1e-4) and stats["cost_drift"] > 1.2
    assert [b["batch"] for b in stats["buckets"]] == ["1..2", "3..12", "13..inf"]
    last = controller.plan(8, 120.0)
    assert (controller.stats()["buckets"][1]["k"], controller.stats()["buckets"][1]["d"]) == (last.k, last.d)
    assert stats["buckets"][2]["k"] is None  # never visited
    assert stats["overhead_seconds"] > 0.0
    ema = AdaptiveController(preset(), DEPTH, policy="ema").stats()
    assert ema["policy"] == "ema" and len(ema["buckets"]) == 3 and ema["acceptance_positions"] == 0


def test_the_ema_policy_reports_no_plan_for_a_bucket_no_batch_entered():
    """As the goodput policy's: `stats()["buckets"]` (and /metrics' spec_plan_k, which skips k=None) gives a plan only
    for the buckets that ran. The EMA policy reported its starting candidate for every bucket, so /metrics showed a
    plan for batch sizes never served."""
    controller = AdaptiveController(preset(), DEPTH, policy="ema")
    assert [b["k"] for b in controller.stats()["buckets"]] == [None, None, None]
    plan = controller.plan(8, 100.0)
    buckets = controller.stats()["buckets"]
    assert (buckets[1]["k"], buckets[1]["d"]) == (plan.k, plan.d) and buckets[0]["k"] is buckets[2]["k"] is None


def test_a_metrics_scrape_reports_the_plans_while_the_engine_thread_changes_the_controller():
    """/metrics is scraped on the server's thread while the engine's changes the controller: a scrape that iterated
    the controller's live dicts (each plan's own price, added as pairs of rounds price it) failed when one grew
    meanwhile (RuntimeError: dictionary changed size during iteration, a 500). It reports the plan per bucket."""
    from prometheus_client import CollectorRegistry, generate_latest

    from looped_spec import SamplingParams
    from looped_spec.engine.stats import EngineCollector

    class GrowsWhileIterated(dict):
        """Stands in for the engine's thread pricing another plan while the scrape iterates the prices."""

        def __iter__(self):
            for key in super().__iter__():
                self[(len(self), 2, 1)] = [0.0, 1]
                yield key

    engine = make_engine("ouro", speculation="adaptive")
    engine.generate([[1, 5, 9, 2]], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.controller.cost.own_prices = GrowsWhileIterated({(0, 2, 1): [0.0, 1]})
    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, "m"))
    assert "looped_spec:spec_plan_k" in generate_latest(registry).decode()  # the scrape succeeds
    plans = [b for b in engine.controller.policy.describe() if b["k"] is not None]
    assert plans  # the batch of one ran: its bucket has a plan
    for bucket in plans:
        labels = {"model_name": "m", "bucket": bucket["batch"]}
        scraped = [registry.get_sample_value(f"looped_spec:spec_plan_{x}", labels) for x in "kd"]
        assert scraped == [bucket["k"], bucket["d"]]


def test_the_price_of_speculation_learns_from_pairs_with_the_profile_as_a_prior():
    """Pairs of adjacent rounds: the price is the mean log difference shrunk to the profile's price (PRICE_PRIOR
    pairs of no difference), a single pair's step clipped, and speculative rounds' drift divided by it."""
    cost = PassCost(preset().cost, DEPTH)
    assert cost.speculative_factor() == 1.0
    for _ in range(PRICE_PRIOR):
        cost.observe_pair(math.log(1.2), 0.0, memory=16)
    assert cost.speculative_factor() == pytest.approx(1.2**0.5)  # 4 pairs against the prior's 4
    for _ in range(200):
        cost.observe_pair(math.log(1.2) + 0.3, 0.3, memory=16)  # the drift of the moment cancels in a pair
    assert cost.speculative_factor() == pytest.approx(1.2, rel=1e-3)
    before = cost.speculative_factor()
    cost.observe_pair(5.0, 0.0, memory=16)  # a stalled round
    assert math.log(cost.speculative_factor() / before) == pytest.approx(0.25 / 16)
    cost.observe(2.4, 1.0, speculative=True)  # a speculative round at its price: the drift factor sees 2.4 / 1.2-ish
    plain = PassCost(preset().cost, DEPTH)
    plain.observe(2.0, 1.0)
    assert cost.drift == pytest.approx(plain.drift, rel=0.02)


def test_each_plan_s_own_price_learns_beside_the_shared_one():
    """A plan's own price starts at the shared price and moves to its own pairs' mean (the shared price counted as
    2 × PRICE_PRIOR of them); other plans stay at the shared price. A rival read beside a plan is priced as that plan's
    price plus their difference, and a single pair's step is clipped."""
    cost = PassCost(preset().cost, DEPTH)
    dear, cheap, other = (0, 2, 1), (0, 2, 2), (0, 3, 3)
    assert cost.speculative_factor(dear) == cost.speculative_factor() == 1.0 and cost.own_pairs(dear) == 0
    for _ in range(2 * PRICE_PRIOR):
        cost.observe_pair(math.log(1.3) + 0.2, 0.2, memory=16, key=dear)  # the drift of the moment cancels
    shared = cost.speculative_factor()
    assert cost.own_pairs(dear) == 2 * PRICE_PRIOR and cost.speculative_factor(other) == shared > 1.0
    # the shared price moved to ~1.3^(8/12); the plan's own deviation is half of what is left (8 pairs, prior 8)
    assert 1.0 < shared < cost.speculative_factor(dear) < 1.3
    for _ in range(400):
        cost.observe_pair(math.log(1.3), 0.0, memory=16, key=dear)
    assert cost.speculative_factor(dear) == pytest.approx(1.3, rel=2e-3)
    for _ in range(400):  # the rival runs 20 % cheaper than the plan in use, next to it
        cost.observe_rival(0.1 + math.log(0.8), 0.1, 16, cheap, dear)
    assert cost.speculative_factor(cheap) == pytest.approx(1.3 * 0.8, rel=2e-3)
    assert cost.own_pairs(cheap) == 400 and cost.speculative_factor(dear) == pytest.approx(1.3, rel=2e-3)
    before = cost.speculative_factor(cheap)
    cost.observe_rival(5.0, 0.0, 16, cheap, dear)  # a stalled round
    assert math.log(cost.speculative_factor(cheap) / before) == pytest.approx(0.25 / 16)


def test_every_tunable_is_listed_in_the_docs():
    """docs/adaptive.md "Tunables" names every ControlSettings field with its default."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "adaptive.md").read_text()
    table = text[text.index("## Tunables") : text.index("## What was removed")]
    for f in dataclasses.fields(ControlSettings):
        default = f.default
        shown = f"{default:g}" if isinstance(default, float) else str(default)
        assert f"| `{f.name}` | {shown} |" in table, f.name


def test_the_docs_give_every_tunable_s_allowed_interval_and_policy():
    """docs/adaptive.md "Tunables" shows the interval ControlSettings accepts for each field, and which fields only the
    goodput policy reads (setting one under the EMA policy is an error, so a reader must know which)."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "adaptive.md").read_text()
    table = text[text.index("## Tunables") : text.index("## What was removed")]
    for f in dataclasses.fields(ControlSettings):
        only = ", goodput only" if f.metadata["policy"] == "goodput" else ""
        row = next(line for line in table.splitlines() if line.startswith(f"| `{f.name}` |"))
        assert row.split(" | ")[2] == f.metadata["allowed"] + only, f.name


def test_request_memory_under_the_ema_policy_is_refused():
    """A request's own agreement feeds only the batch's (`batch_alpha`), which only the goodput policy prices with:
    under the EMA policy `request_memory` changed nothing and was accepted."""
    assert ControlSettings(request_memory=8.0).set_for_another_policy("ema") == ["request_memory"]
    with pytest.raises(ValueError, match=r"control\.request_memory=8\.0: only the goodput policy reads it"):
        make_engine("ouro", speculation="adaptive", policy="ema", control={"request_memory": 8.0})


def test_drift_rounds_below_one_is_refused_not_taken_as_one():
    """The drift factor remembers at least one round (its weight is 1 / max(drift_rounds, 1)): a value below 1 would
    have been accepted and run as 1."""
    with pytest.raises(ValueError, match=r"drift_rounds=0\.5 must be in \[1, inf\)"):
        ControlSettings(drift_rounds=0.5)
    assert ControlSettings(drift_rounds=1.0).drift_rounds == 1.0


def test_a_price_probe_pairs_rounds_of_one_bucket_and_keeps_the_policy_s_decisions(tmp_path):
    """A batch that falls into another bucket: a probe never runs as that bucket's first round (it would pair rounds
    of two batch sizes and hide the bucket's first decision from the trace). Found by an outside audit."""
    full = [0.95] * (DEPTH - 1) + [1.0]
    cfg = AdaptiveSpecConfig.parse({"model": "m", "full_depth": DEPTH, "cost": ideal_cost(32),
        "acceptance": {"alpha": full, "rho": [0.0] * DEPTH, "positions": 1000},
        "buckets": [{"min_batch": 1, "max_batch": 2, "candidates": [[0, 0], [2, 1]], "theta_up": 0.5, "theta_down": 0},
                    {"min_batch": 3, "max_batch": None, "candidates": [[0, 0], [3, 1]], "theta_up": 0.5,
                     "theta_down": 0}]})  # fmt: skip
    settings = ControlSettings(prior_share=1e9, readout_budget=1e-6, price_probe_interval=2)
    for switch_at in range(20, 60):
        path = tmp_path / f"trace{switch_at}.jsonl"
        controller = AdaptiveController(cfg, DEPTH, settings=settings, trace_path=path)
        workload = Workload(PassCost(cfg.cost, DEPTH), seed=switch_at)
        plans = []
        for i in range(switch_at + 40):
            batch = 4 if i < switch_at or i >= switch_at + 20 else 1
            plan = controller.plan(batch, 100.0)
            plans.append(plan)
            controller.observe(workload.feedback(plan, Phase(batch, full, 1)))
        controller.close()
        events = [json.loads(line) for line in path.read_text().splitlines()]
        probes = {e["plan_id"] for e in events if e["event"] == "decision" and "price probe" in e["what"]}
        # every probe read one plan's own price (plain beside the plan in use, or another option beside it)
        assert probes and sum(n for _, n in controller.cost.own_prices.values()) == len(probes)
        same_bucket = [plans[i - 1].bucket == plans[i].bucket for i in probes]
        assert all(same_bucket) and all((plans[i - 1].k, plans[i - 1].d) != (plans[i].k, plans[i].d) for i in probes)
        started = {e["bucket"] for e in events if e["event"] == "decision" and e["what"].startswith("start")}
        assert started == {0, 1}, switch_at


@pytest.mark.parametrize("interval", [2, 4, 8])
def test_the_first_price_pairs_come_one_a_decision(interval):
    """The machine's price is read within a few generates: after the first probe (at `price_probe_interval`), one
    comes every `decision_interval` rounds until 2 × PRICE_PRIOR pairs outweigh the profile's price, then at the
    interval again."""
    full = [0.95] * (DEPTH - 1) + [1.0]
    cfg = AdaptiveSpecConfig.parse({"model": "m", "full_depth": DEPTH, "cost": ideal_cost(32),
        "acceptance": {"alpha": full, "rho": [0.0] * DEPTH, "positions": 1000},
        "buckets": [{"min_batch": 1, "max_batch": None, "candidates": [[0, 0], [3, 1]], "theta_up": 0.5,
                     "theta_down": 0}]})  # fmt: skip
    settings = ControlSettings(prior_share=1e9, readout_budget=1e-6, decision_interval=interval)
    controller = AdaptiveController(cfg, DEPTH, settings=settings)
    workload = Workload(PassCost(cfg.cost, DEPTH), seed=3)
    paired = []  # the rounds that completed a pair
    for i in range(300):
        plan = controller.plan(4, 100.0)
        pairs = controller.cost.price_pairs
        controller.observe(workload.feedback(plan, Phase(4, full, 1)))
        if controller.cost.price_pairs > pairs:
            paired.append(i)
    first = paired[0]
    assert first <= settings.price_probe_interval + 2
    fast = [b - a for a, b in zip(paired, paired[1 : 2 * PRICE_PRIOR])]
    assert fast == [interval] * (2 * PRICE_PRIOR - 1), paired
    assert paired[2 * PRICE_PRIOR + 1] - paired[2 * PRICE_PRIOR] == settings.price_probe_interval


def test_a_price_probe_follows_a_round_that_drafted():
    """A round whose requests drafted nothing (all near their end) ran as plain decoding: a probe right after it would
    price plain against plain. Probes come only after rounds that drafted, and each is counted as one pair."""
    full = [0.95] * (DEPTH - 1) + [1.0]
    cfg = AdaptiveSpecConfig.parse({"model": "m", "full_depth": DEPTH, "cost": ideal_cost(32),
        "acceptance": {"alpha": full, "rho": [0.0] * DEPTH, "positions": 1000},
        "buckets": [{"min_batch": 1, "max_batch": None, "candidates": [[0, 0], [3, 1]], "theta_up": 0.5,
                     "theta_down": 0}]})  # fmt: skip
    settings = ControlSettings(prior_share=1e9, readout_budget=1e-6, price_probe_interval=2)
    controller = AdaptiveController(cfg, DEPTH, settings=settings)
    workload = Workload(PassCost(cfg.cost, DEPTH), seed=2)
    drafted, probes = [], []
    for i in range(300):
        plan = controller.plan(4, 100.0)
        pairs = controller.cost.price_pairs
        if plan.k == 0 and i and controller.policy.options[controller.policy.states[0].current][0] > 0:
            probes.append(i)
        feedback = workload.feedback(plan, Phase(4, full, 1))
        if plan.k and i % 3 == 0:  # every third round: its requests drafted nothing
            feedback = dataclasses.replace(feedback, num_proposed=[0] * 4, num_accepted=[0] * 4)
        drafted.append(feedback.total_proposed > 0)
        controller.observe(feedback)
        assert controller.cost.price_pairs - pairs == (1 if probes and probes[-1] == i else 0)
    assert len(probes) >= 10
    assert all(drafted[i - 1] for i in probes), [i for i in probes if not drafted[i - 1]]


def test_readouts_keep_to_the_budget_while_speculation_is_near_paying_but_under_the_margin():
    """Plain decoding runs where speculation is predicted ~1.25x plain but `plain_margin` asks for 1.5x: readouts are
    worth at most their full budget there, not more (the mutation check, the outlook not capped at 1: readouts at
    outlook² ~1.5x, ~1.35x the budget in all)."""
    budget = 0.01
    settings = ControlSettings(readout_budget=budget, plain_margin=0.5)
    controller = AdaptiveController(preset(), DEPTH, settings=settings)
    truth = PassCost(preset().cost, DEPTH)
    workload = Workload(truth, noise=0.05, seed=1)
    phase = Phase(8, [0.75, 0.85, 0.95, 1.0], 1, 200.0)
    extra, total, plain = 0.0, 0.0, 0
    for _ in range(2000):
        plan = controller.plan(phase.batch, phase.context)
        total += workload.seconds(plan.k, plan.d, phase.batch, phase.context)
        plain += plan.k == 0
        if plan.measure_depths:
            extra += truth.measure_seconds(plan.k, plan.d, phase.batch)
        controller.observe(workload.feedback(plan, phase))
    rate = controller.policy.predict(phase.batch, phase.context)
    assert 1.1 < max(rate) / rate[controller.policy.plain] < 1.5 and plain >= 1900  # near paying, plain
    assert 0.5 * budget <= extra / total <= 1.1 * budget, extra / total
