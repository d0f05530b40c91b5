"""Acceptance from counterfactual bits (replay, Markov model) and the hardware cost profile (fit, interpolation)."""

from __future__ import annotations

import random

import pytest

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig, load_adapter
from looped_spec.control import AdaptiveController, AdaptiveSpecConfig
from looped_spec.control.acceptance import bit_statistics, markov_tokens, simulate_tokens
from looped_spec.control.costprofile import CostProfile, fit_coefficients, round_features
from looped_spec.control.plan import RoundFeedback
from looped_spec.tuning.tuner import measure_match_bits


def markov_bits(alpha: float, rho: float, length: int, count: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    p01 = alpha * (1.0 - rho)
    p11 = rho + p01
    out = []
    for _ in range(count):
        seq = [int(rng.random() < alpha)]
        for _ in range(length - 1):
            seq.append(int(rng.random() < (p11 if seq[-1] else p01)))
        out.append(seq)
    return out


@pytest.mark.parametrize("alpha,rho", [(0.5, 0.0), (0.8, 0.5), (0.3, 0.7), (0.95, 0.2)])
def test_markov_expectation_matches_replay_of_markov_bits(alpha, rho):
    bits = markov_bits(alpha, rho, 3000, 40, seed=1)
    a, r, n = bit_statistics(bits)
    assert n == 120000 and a == pytest.approx(alpha, abs=0.01) and r == pytest.approx(rho, abs=0.02)
    for k in (1, 3, 6):
        tokens, rounds = simulate_tokens(bits, k)
        assert tokens / rounds == pytest.approx(markov_tokens(alpha, rho, k), rel=0.01)


def test_markov_reduces_to_geometric_and_bounds():
    for alpha in (0.0, 0.4, 0.9):
        for k in (1, 2, 5):
            assert markov_tokens(alpha, 0.0, k) == pytest.approx(sum(alpha**j for j in range(k + 1)))
    assert markov_tokens(1.0, 0.3, 4) == 5.0 and markov_tokens(0.7, 0.2, 0) == 1.0


def test_replay_rules_by_hand():
    # one sequence of 6 generated tokens (5 bits); K = 2: round 1 accepts 2 (bits 1,1) -> s = 3; round 2 sees
    # bit[3] = 0 -> 1 token; round 3: one token left to generate after s = 4 -> K cut to 0 -> 1 token
    assert simulate_tokens([[1, 1, 1, 0, 1]], 2) == (5, 3)
    assert simulate_tokens([[0, 0, 0]], 3) == (3, 3)
    assert simulate_tokens([[], [1]], 4) == (1, 1)


@pytest.mark.parametrize("model", ["tiny-ouro", "tiny-nanbeige"])
def test_replayed_acceptance_equals_the_engines_speculative_acceptance(model):
    """Counterfactual bits of plain decoding predict a fixed (K, d)'s accepted tokens exactly (greedy)."""
    adapter = load_adapter(model, dtype="float32", device="cpu")
    prompts = ["def add(a, b):\n    return", "The river ran past the old mill, where", "import os\nimport"]
    tokens = 24
    bits = measure_match_bits(adapter, prompts, tokens)
    assert all(len(seq) == tokens - 1 for per_depth in bits for seq in per_depth)
    for k, d in [(1, 1), (3, 1), (2, adapter.full_depth - 1)]:
        engine = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=k, d=d), max_batch_size=1)
        for prompt, seq in zip(prompts, bits[d - 1]):
            before = (engine.stats.num_rounds, engine.stats.num_accepted_tokens)
            engine.generate([prompt], SamplingParams(max_tokens=tokens, ignore_eos=True))
            rounds = engine.stats.num_rounds - before[0]
            accepted = engine.stats.num_accepted_tokens - before[1]
            replay_tokens, replay_rounds = simulate_tokens([seq], k)
            assert (rounds, accepted) == (replay_rounds, replay_tokens - replay_rounds), (k, d, prompt)


TRUE_COEFFICIENTS = {1: [0.001, 0.0005, 0.0008, 0.003], 8: [0.002, 0.001, 0.004, 0.005]}


def synthetic_times(depth: int, noise: float, seed: int):
    rng = random.Random(seed)
    cells = {}
    for b, coef in TRUE_COEFFICIENTS.items():
        cells[b] = {
            (k, d): sum(c * f for c, f in zip(coef, round_features(k, d, depth))) * (1.0 + noise * rng.gauss(0, 1))
            for k in range(1, 6)
            for d in range(1, depth)
        }
    return cells


def test_cost_fit_recovers_known_coefficients():
    cells = synthetic_times(4, 0.0, 0)
    for b, coef in TRUE_COEFFICIENTS.items():
        assert fit_coefficients(cells[b], 4) == pytest.approx(coef, rel=1e-4)
    noisy = synthetic_times(4, 0.02, 1)  # 2 % noise per cell: the fit's predictions stay within a few percent
    clean = synthetic_times(4, 0.0, 0)
    for b in TRUE_COEFFICIENTS:
        coef = fit_coefficients(noisy[b], 4)
        for (k, d), seconds in clean[b].items():
            assert sum(c * f for c, f in zip(coef, round_features(k, d, 4))) == pytest.approx(seconds, rel=0.06)


def test_cost_fit_with_collinear_cells_still_predicts_them():
    """D = 2: every cell has d = 1, so the four coefficients are not identifiable; predictions still are."""
    cells = {(k, 1): 0.002 + 0.0015 * (k + 1) for k in range(1, 6)}
    coef = fit_coefficients(cells, 2)
    for (k, d), seconds in cells.items():
        assert sum(c * f for c, f in zip(coef, round_features(k, d, 2))) == pytest.approx(seconds, rel=1e-6)


def test_profile_interpolates_and_extrapolates_in_batch_size():
    cells = synthetic_times(4, 0.0, 0)
    profile = CostProfile.fit(4, {1: 0.004, 8: 0.011}, cells)
    assert profile.predict(0, 0, 1) == pytest.approx(0.004) and profile.predict(0, 0, 8) == pytest.approx(0.011)
    assert profile.predict(0, 0, 4) == pytest.approx(0.004 + 3 / 7 * 0.007)
    assert profile.predict(0, 0, 15) == pytest.approx(0.011 + 7 / 7 * 0.007)  # linear beyond the last
    spec1, spec8 = profile.spec_seconds_at_profiled(2, 1)
    assert profile.predict(2, 1, 8) == pytest.approx(spec8)
    assert profile.predict(2, 1, 4) == pytest.approx(spec1 + 3 / 7 * (spec8 - spec1))


def profiled_config(alpha, initial_index=0, candidates=None) -> AdaptiveSpecConfig:
    profile = CostProfile.fit(4, {1: 0.008, 8: 0.03}, synthetic_times(4, 0.0, 0))
    candidates = candidates or [[0, 0], [1, 1], [3, 1], [2, 2], [5, 1]]
    bucket = {"min_batch": 1, "max_batch": None, "candidates": candidates, "initial_index": initial_index}
    bucket.update(theta_up=0.9, theta_down=0.1)
    return AdaptiveSpecConfig.parse(
        {
            "model": "t",
            "full_depth": 4,
            "buckets": [bucket],
            "acceptance": {"alpha": alpha, "rho": [0.0] * 4, "positions": 100},
            "cost": profile.to_dict(),
        }
    )


def test_goodput_with_a_profile_starts_at_the_best_predicted_plan_without_exploring():
    from looped_spec.control.goodput import TRIAL_WITHIN

    config = profiled_config([0.9, 0.95, 0.99, 1.0])
    ctl = AdaptiveController(config, 4)  # the default policy: goodput
    assert ctl.policy_name == "goodput"
    profile = CostProfile(4, **config.cost.model_dump())
    options = [(0, 0), (1, 1), (3, 1), (2, 2), (5, 1)]
    for batch in (1, 8):
        ctl = AdaptiveController(config, 4)
        ctl.policy.refine_cost = True

        def rate(o, batch=batch):
            return markov_tokens(0.9 if o[1] == 1 else 0.95, 0, o[0]) / profile.predict(*o, batch)

        best = max(options, key=rate)
        plans = [(p.k, p.d) for p in (ctl.plan(batch) for _ in range(40))]
        assert plans[0] == best, batch
        # no exploration: other plans only as cost trials of options predicted within TRIAL_WITHIN of the best
        assert all(rate(p) >= TRIAL_WITHIN * rate(best) for p in plans), batch
        assert any(rate(o) < TRIAL_WITHIN * rate(best) for o in options)  # ... which some options are not


def test_goodput_speculates_only_while_a_prediction_clears_the_margin_over_plain():
    """Every speculative option, not just the first step away from plain, must beat plain by plain_margin."""
    ctl = AdaptiveController(profiled_config([0.9, 0.95, 0.99, 1.0]), 4)
    policy = ctl.policy
    policy.probes = None  # its plain probe rounds (one in 16 near the bar) are tested in test_probes.py
    assert [o[:2] for o in policy.states[0].options] == [(0, 0), (1, 1), (3, 1), (2, 2), (5, 1)]
    assert policy.plain_margin == pytest.approx(0.05) and policy.hysteresis == pytest.approx(0.03)
    predicted = [100.0, 104.0, 102.5, 90.0, 80.0]  # tokens/s per option
    policy.rates = lambda st, batch, context=None, remaining=None: list(predicted)

    def plans(n=40):
        return {(p.k, p.d) for p in (ctl.plan(1) for _ in range(n))}

    assert plans() == {(0, 0)}  # the best speculative option is 4 % over plain: not enough to start
    predicted[1] = 108.0
    assert (1, 1) in plans() and plans() == {(1, 1)}  # 8 % over plain: speculate
    predicted[1], predicted[2] = 104.0, 104.5  # (1, 1) keeps its place down to 1.05 * 0.97 = 1.0185x plain;
    assert plans() == {(1, 1)}  # (3, 1) is 0.5 % better but not eligible (under 1.05x plain)
    predicted[1] = 101.0  # in use, but under the hold bar: (3, 1) at 1.045x is not eligible either
    assert (0, 0) in plans() and plans() == {(0, 0)}  # -> plain, not the other speculative option


def test_goodput_switches_off_when_acceptance_collapses():
    ctl = AdaptiveController(profiled_config([0.9, 0.95, 0.99, 1.0]), 4)
    first = ctl.plan(1)
    assert first.k > 0
    for _ in range(1000):  # measured rounds (every 4th..64th) of zero agreement
        plan = ctl.plan(1)
        matches = [0, 0, 0, plan.k + 1] if plan.measure_depths else []
        trials = [plan.k + 1] * 4 if plan.measure_depths else []
        ctl.observe(RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, 1, [plan.k], [0],
                                  depth_matches=matches, depth_trials=trials))  # fmt: skip
    assert ctl.plan(1).k == 0


def test_ema_timing_never_compares_different_batch_sizes():
    """Plain rounds measured at B=1 are fast per request; a candidate timed at B=8 must not be judged by them."""
    bucket = {"min_batch": 1, "max_batch": None, "candidates": [[1, 1], [2, 1]], "theta_up": 0.99}
    bucket.update(theta_down=0.1, beta=1.0, min_samples=1, interval=1, initial_index=0)
    config = AdaptiveSpecConfig.parse(
        {"model": "t", "buckets": [bucket], "disable": {"enabled": True, "threshold": 0.1, "use_timing": True}}
    )
    ctl = AdaptiveController(config, 4, policy="ema")
    for _ in range(6):  # plain rounds at B=1: 1 token per request per 0.001 s
        plan = ctl.policy.select(0, 1, 0)
        ctl.observe(RoundFeedback(99, 0, 0, 0, -1, 1, [0], [0], 0.001))
    for _ in range(20):  # speculative rounds at B=8: 1.5 tokens per request per 0.01 s (slower per request)
        plan = ctl.plan(8)
        ctl.observe(RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, 8, [plan.k] * 8,
                                  [1] * 8 if plan.k == 1 else [1] * 8, 0.01))  # fmt: skip
    assert ctl.plan(8).k > 0  # acceptance 0.5-1.0 keeps it on; the B=1 plain timing never switched it off


def test_goodput_measured_cost_corrects_a_wrong_profile_at_the_same_batch_size():
    """The profile under-prices speculation: once its rounds are measured dearer, the policy goes back to plain."""
    from looped_spec.control.goodput import CORRECTION_MIN_ROUNDS

    config = profiled_config([0.05, 0.05, 0.05, 1.0], candidates=[[0, 0], [2, 1]])  # prior: do not speculate
    profile = CostProfile(4, **config.cost.model_dump())
    ctl = AdaptiveController(config, 4)
    ctl.policy.refine_cost = True
    batch = 8

    def feed(plan, seconds, depth_matches=()):
        trials = [plan.k + 1] * 4 if depth_matches else []
        accepted = [plan.k] * batch  # every draft accepted
        fb = RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, batch, [plan.k] * batch, accepted,
                           seconds, depth_matches=list(depth_matches), depth_trials=trials)  # fmt: skip
        ctl.observe(fb)

    for _ in range(CORRECTION_MIN_ROUNDS):  # plain rounds, timed as the profile predicts
        plan = ctl.plan(batch)
        assert plan.k == 0
        feed(plan, profile.predict(0, 0, batch))
    for _ in range(200):  # counterfactual readouts: the text is easy at every depth
        plan = ctl.plan(batch)
        if plan.k:
            break
        feed(plan, 0.0, depth_matches=[plan.k + 1] * 4)
    spec = (plan.k, plan.d)
    assert plan.k > 0  # switched, or put on a cost trial (predicted within TRIAL_WITHIN of plain)
    gain = 1.0  # the measured cost below is 3x the profile's: far slower than plain whatever the acceptance
    feed(plan, profile.predict(*spec, batch) * gain * 3.0)  # really 3x dearer than predicted: slower than plain
    ks = []
    for _ in range(CORRECTION_MIN_ROUNDS + 12):
        plan = ctl.plan(batch)
        ks.append(plan.k)
        feed(plan, profile.predict(plan.k, plan.d, batch) * (gain * 3.0 if plan.k else 1.0))
    assert ks[: CORRECTION_MIN_ROUNDS - 1] == [spec[0]] * (CORRECTION_MIN_ROUNDS - 1)  # not before enough rounds
    assert ks[-4:] == [0] * 4  # then plain again
    assert ctl.policy.cost_factors(plan.bucket)[spec] == pytest.approx(gain * 3.0)


def test_sampled_plain_rounds_report_the_real_full_depth_agreement():
    """Depth D's entry counts greedy full-depth agreement with the committed token; sampling often disagrees."""
    from conftest import load

    engine = LoopedSpecEngine(load("ouro"), speculation=SpeculativeConfig(k=0, measure_depths=True))
    seen = []
    observe = engine.controller.observe
    engine.controller.observe = lambda fb: (seen.append(fb), observe(fb))
    params = SamplingParams(max_tokens=30, temperature=1.5, seed=3, ignore_eos=True)
    engine.generate([[105, 116, 158, 23, 27, 211, 69]], params)
    matches = sum(fb.depth_matches[-1] for fb in seen)
    trials = sum(fb.depth_trials[-1] for fb in seen)
    assert trials == 29 and matches < trials // 2  # a random-weight model sampled at T=1.5 rarely hits its argmax


def test_goodput_decides_every_few_rounds_and_when_the_batch_size_changes():
    """Deciding every round cost tiny models 2-3 % of a round; the estimates move slowly. Decisions come every
    max(interval, MIN_DECISION_GAP) rounds of a bucket, and at once when the batch size moves by an eighth
    (at least 1)."""
    from looped_spec.control.goodput import MIN_DECISION_GAP

    ctl = AdaptiveController(profiled_config([0.9, 0.95, 0.99, 1.0]), 4)
    policy = ctl.policy
    decided = []
    decide = policy._decide
    policy._decide = lambda st, batch, context=None, remaining=None: (
        decided.append((st.rounds, batch)),
        decide(st, batch, context, remaining),
    )
    gap = max(policy.buckets[ctl.bucket_for(2)].config.interval, MIN_DECISION_GAP)
    rounds = 4 * gap + 2  # the next scheduled decision is gap - 2 rounds away
    for _ in range(rounds):
        ctl.plan(2)
    assert [r for r, _ in decided] == list(range(1, rounds + 1, gap))
    ctl.plan(1)  # same bucket, another batch size: decided now, ahead of the schedule
    assert decided[-1] == (rounds + 1, 1) and len(decided) == len(range(1, rounds + 1, gap)) + 1
