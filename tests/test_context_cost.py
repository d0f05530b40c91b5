"""Context-aware cost profile: fitting round seconds against the mean context, predicting with and without a
context, old presets unchanged, the goodput policy's choice moving with the context, the engine passing it."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from conftest import make_engine

from looped_spec import SamplingParams
from looped_spec.control import AdaptiveController, AdaptiveSpecConfig, OffController, read_preset_file
from looped_spec.control.costprofile import CONTEXT_FIELDS, CostProfile, fit_pass_slopes, passes, round_features
from looped_spec.control.presets import load_preset
from looped_spec.control.schema import CostConfig
from looped_spec.tuning.report import dump_json, preset_data
from looped_spec.tuning.tuner import TimedRound, context_lines, fit_profile, mean_contexts, theil_sen_slope

PRESETS = Path(__file__).resolve().parents[1] / "presets"
DEPTH = 4
GRID = [(k, d) for k in (1, 2, 3, 5) for d in (1, 2, 3)]
#: Known truth per batch size: plain (intercept s, slope s/token), the four-feature coefficients of the
#: speculative rounds' intercepts and of their slopes (order of `round_features`). Slopes follow the pass
#: model: per-pass a and per-query-pass b seconds per context token give [a + b, a, b, 0], plain D·(a + b).
PASS_SLOPES = {1: (3.0e-7, 2.0e-7), 8: (2.5e-6, 1.25e-6)}
TRUTH = {
    b: ((intercept, DEPTH * (a + q)), coef, [a + q, a, q, 0.0])
    for (b, (a, q)), (intercept, coef) in zip(
        PASS_SLOPES.items(), [(0.004, [6.0e-4, 2.0e-4, 4.0e-4, 2.0e-3]), (0.011, [1.0e-3, 3.0e-4, 9.0e-4, 3.0e-3])]
    )
}
PROMPT = {1: 30.0, 8: 45.5}  # mean prompt length of the batch: the first decode round's context


def true_line(batch: int, k: int, d: int) -> tuple[float, float]:
    (a_plain, b_plain), a_coef, b_coef = TRUTH[batch]
    if k == 0:
        return a_plain, b_plain
    x = round_features(k, d, DEPTH)
    return sum(c * f for c, f in zip(a_coef, x)), sum(c * f for c, f in zip(b_coef, x))


def synthetic_samples(seed: int, noise: float = 0.02, outliers: float = 0.1, horizon: int = 96):
    """Timed rounds from the known lines: 3 runs per cell (the first 15 % slower all along, a disturbed run),
    every round with `noise` relative Gaussian noise and, with probability `outliers`, off by ±30 %."""
    rng = random.Random(seed)
    samples = {}
    for b in TRUTH:
        samples[b] = {}
        for k, d in [(0, 0), *GRID]:
            a, slope = true_line(b, k, d)
            step = 1.0 + 0.5 * k  # a speculative round commits more than one token per request
            runs = []
            for run in range(3):
                level = 1.15 if run == 0 else 1.0
                rounds, context = [], PROMPT[b]
                while context < PROMPT[b] + horizon:
                    y = (a + slope * context) * level * (1.0 + noise * rng.gauss(0.0, 1.0))
                    if rng.random() < outliers:
                        y *= 1.3 if rng.random() < 0.5 else 0.7
                    rounds.append(TimedRound(y, context))
                    context += step
                runs.append(rounds)
            samples[b][(k, d)] = runs
    return samples


def test_theil_sen_ignores_wild_points_and_run_levels():
    points = [(float(x), 2.0 + 0.5 * x) for x in range(40)]
    for i in range(0, 40, 5):  # 20 % of the points, wildly off (least squares would follow them)
        points[i] = (points[i][0], points[i][1] * (3.0 if i > 20 else 0.2))
    assert theil_sen_slope([points]) == pytest.approx(0.5)
    assert theil_sen_slope([points], max_pairs=300) == pytest.approx(0.5, rel=0.05)  # a sample of the pairs
    shifted = [(x, y + 10.0) for x, y in points[::-1]]  # a second run at another level, contexts descending
    assert theil_sen_slope([points, shifted]) == pytest.approx(0.5)  # pairs stay within a run
    assert theil_sen_slope([[(1.0, 2.0), (1.0, 3.0)], [(5.0, 1.0)]]) == 0.0  # no pair with different contexts


def test_context_fit_recovers_known_intercepts_and_slopes():
    """Noise-free rounds with ±30 % outliers and a disturbed run: lines and both coefficient sets come back."""
    profile, report = fit_profile(DEPTH, synthetic_samples(seed=1, noise=0.0))
    assert profile.has_context
    for i, b in enumerate(profile.batch_sizes):
        (a_plain, b_plain), a_coef, b_coef = TRUTH[b]
        assert profile.plain_intercept[i] == pytest.approx(a_plain, rel=1e-6)
        assert profile.plain_slope[i] == pytest.approx(b_plain, rel=1e-6)
        assert profile.intercept_coefficients[i] == pytest.approx(a_coef, rel=1e-4, abs=1e-9)
        assert profile.slope_coefficients[i] == pytest.approx(b_coef, rel=1e-4, abs=1e-12)
        assert report[str(b)]["1,1"]["slope_s_per_token"] == pytest.approx(true_line(b, 1, 1)[1], rel=1e-3)


@pytest.mark.parametrize("seed", [2, 3])
def test_context_fit_with_noise_and_outliers_predicts_within_tolerance(seed):
    """2 % noise, 10 % of the rounds off by ±30 %, one run 15 % slow. Within the tuning contexts predictions
    are within a few percent; far beyond them the slope's own error shows (a 96-token range pins it loosely
    where it adds little to a round, e.g. plain at B = 1: +5 % over the range; a least-squares slope is off by
    about three times as much on such data)."""
    samples = synthetic_samples(seed)
    profile, _ = fit_profile(DEPTH, samples)
    lines = context_lines(samples)
    for b in TRUTH:
        for k, d in [(0, 0), *GRID]:
            a, slope = true_line(b, k, d)
            if b == 8:  # here the context adds 15-35 % to a round over the tuning range
                assert lines[b][(k, d)][1] == pytest.approx(slope, rel=0.25), (b, k, d)
            for context, tolerance in ((PROMPT[b] + 48, 0.03), (0.0, 0.06), (1000.0, 0.15)):
                expected = a + slope * context
                assert profile.predict(k, d, b, context) == pytest.approx(expected, rel=tolerance), (b, k, d, context)
    contexts = [r.context for runs in samples[8].values() for run in runs for r in run]
    assert profile.reference_context[1] == pytest.approx(sum(contexts) / len(contexts))
    # no context: the averaged profile (the old behaviour), the best run's trimmed mean (not the disturbed run)
    assert profile.predict(0, 0, 8) == pytest.approx(true_line(8, 0, 0)[0] + 15e-6 * (45.5 + 47.5), rel=0.03)


def test_context_fit_guards_slopes_and_batch_order():
    samples = synthetic_samples(seed=4, noise=0.0, outliers=0.0)
    for run in samples[8][(0, 0)]:  # plain at B = 8 measured cheaper than at B = 1, and falling with the context
        run[:] = [TimedRound(0.003 - 1e-6 * r.context, r.context) for r in run]
    lines = context_lines(samples)
    refs = mean_contexts(samples)
    (a1, b1), (a8, b8) = lines[1][(0, 0)], lines[8][(0, 0)]
    assert b1 >= 0.0 and b8 >= 0.0 and b8 >= b1  # never cheaper at a longer context ...
    assert a8 + b8 * refs[8] >= a1 + b1 * refs[1]  # ... or a bigger B, where the rounds were timed


def test_a_noisy_slope_at_one_batch_size_leaves_the_others_lines_at_their_rounds():
    """An 8-token horizon at B = 8 measures (2, 1)'s slope 20x too steep, its intercept far below its rounds.
    Pooled at context 0 that intercept dragged B = 1's line below zero; pooled where the rounds were timed, each
    line still prices its own rounds (CLI tune test, 2 failures in 6 runs on 2026-12-01)."""
    samples = synthetic_samples(seed=4, noise=0.0, outliers=0.0)
    a, slope = true_line(8, 2, 1)
    for run in samples[8][(2, 1)]:
        run[:] = [TimedRound(a + 20 * slope * r.context - 19 * slope * 80.0, r.context) for r in run]
    lines = context_lines(samples)
    refs = mean_contexts(samples)
    a1, s1 = lines[1][(2, 1)]
    truth = true_line(1, 2, 1)
    assert a1 > 0.0
    assert a1 + s1 * refs[1] == pytest.approx(truth[0] + truth[1] * refs[1], rel=0.01)
    profile, _ = fit_profile(DEPTH, samples)
    assert profile.predict(2, 1, 1, refs[1]) == pytest.approx(truth[0] + truth[1] * refs[1], rel=0.05)


def old_profile() -> dict:
    return {
        "batch_sizes": [1, 4],
        "plain_seconds": [0.004, 0.006],
        "coefficients": [[0.0006, 0.0002, 0.0004, 0.002], [0.001, 0.0003, 0.0009, 0.003]],
    }


def test_predict_without_context_is_the_old_prediction():
    data = old_profile()
    profile = CostProfile(DEPTH, **CostConfig(**data).model_dump())
    assert not profile.has_context and profile.to_dict() == data
    for b in (1, 2, 4, 9):  # profiled, interpolated, profiled, extrapolated from the last two: linear in B
        for k, d in [(0, 0), *GRID]:
            if k == 0:
                at = data["plain_seconds"]
            else:
                at = [sum(c * f for c, f in zip(row, round_features(k, d, DEPTH))) for row in data["coefficients"]]
            old = at[0] + (b - 1) * (at[1] - at[0]) / 3
            assert profile.predict(k, d, b) == pytest.approx(old, rel=1e-12)
            assert profile.predict(k, d, b, None) == profile.predict(k, d, b)
            assert profile.predict(k, d, b, 5000.0) == profile.predict(k, d, b)  # no context terms: ignored
    # with context terms, no context still means the averaged fields, exactly
    fitted, _ = fit_profile(DEPTH, synthetic_samples(seed=5))
    averaged = CostProfile(DEPTH, fitted.batch_sizes, fitted.plain_seconds, fitted.coefficients)
    assert all(fitted.predict(k, d, b) == averaged.predict(k, d, b) for k, d in [(0, 0), *GRID] for b in (1, 3, 8, 20))


@pytest.mark.parametrize("name", ["tiny-ouro", "tiny-nanbeige", "tiny-huginn"])
def test_an_old_format_preset_loads_and_predicts_as_before(name, tmp_path):
    """A shipped preset with its context terms removed (the format before them) loads, ignores contexts and
    is written back unchanged."""
    data = json.loads((PRESETS / f"{name}.json").read_text())
    for field in CONTEXT_FIELDS:
        data["cost"].pop(field, None)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(data))
    config = read_preset_file(path)
    cost = config.cost
    assert cost is not None and not cost.has_context
    assert all(getattr(cost, field) is None for field in CONTEXT_FIELDS)
    depth = config.full_depth
    before = CostProfile(depth, cost.batch_sizes, cost.plain_seconds, cost.coefficients)  # as the policy built it
    policy = AdaptiveController(load_preset(name, depth, preset=path), depth).policy
    now = policy.profile
    options = [(0, 0)] + [(k, d) for k in range(1, 6) for d in range(1, depth)]
    for b in (1, 3, 8, 32, 64):
        for k, d in options:
            assert now.predict(k, d, b) == before.predict(k, d, b)
            assert now.predict(k, d, b, 2000.0) == before.predict(k, d, b)
    st = policy.states[0]
    assert policy.rates(st, 4, 3000.0) == policy.rates(st, 4)  # the policy ignores a context it cannot use
    # written back (as `looped-spec tune --cost-from` does) the cost section is unchanged: no null fields
    assert json.loads(dump_json(preset_data(config)))["cost"] == data["cost"]


@pytest.mark.parametrize("name", ["tiny-ouro", "tiny-nanbeige", "tiny-huginn"])
def test_shipped_presets_carry_context_terms_that_agree_with_their_averages(name):
    """Re-tuned with the context-aware tuner: at each profiled batch size's own reference context the line
    predicts a plain round within 30% of the averaged (trimmed-mean) cost, and cost grows with the context."""
    path = PRESETS / f"{name}.json"
    config = read_preset_file(path)
    cost = config.cost
    assert cost is not None and cost.has_context
    profile = CostProfile(config.full_depth, **cost.model_dump())
    for b, ref, plain in zip(profile.batch_sizes, profile.reference_context, profile.plain_seconds):
        at_ref = profile.predict(0, 0, b, ref)
        assert abs(at_ref - plain) <= 0.3 * plain, (b, at_ref, plain)
        assert profile.predict(0, 0, b, ref + 500) >= at_ref
    assert json.loads(dump_json(preset_data(config)))["cost"] == json.loads(path.read_text())["cost"]


def context_config(data: dict | None = None) -> dict:
    """A preset with a context-aware profile (D = 4): speculation pays at short contexts, not at long ones.

    Per loop pass over one token per request 2.5 ms, plus 10 us per token of context read per query; the
    verifier's K+1 queries each read the context, so a speculative round's slope grows with K while plain's
    does not. Averaged fields: the same model at a 100-token context.
    """
    pass_s, read_s, ref = 2.5e-3, 1.0e-5, 100.0
    intercept, slope = [pass_s, pass_s, 0.0, 0.0], [read_s, 0.0, read_s, 0.0]
    cost = {
        "batch_sizes": [1, 8],
        "plain_seconds": [DEPTH * (pass_s + read_s * ref)] * 2,
        "coefficients": [[a + s * ref for a, s in zip(intercept, slope)]] * 2,
        "reference_context": [ref, ref],
        "plain_intercept": [DEPTH * pass_s] * 2,
        "plain_slope": [DEPTH * read_s] * 2,
        "intercept_coefficients": [intercept] * 2,
        "slope_coefficients": [slope] * 2,
    }
    cost.update(data or {})
    bucket = {"min_batch": 1, "max_batch": None, "candidates": [[0, 0], [1, 1], [2, 1], [3, 1], [2, 2]]}
    bucket.update(theta_up=0.9, theta_down=0.1)
    return {
        "model": "t",
        "full_depth": DEPTH,
        "buckets": [bucket],
        "acceptance": {"alpha": [0.9, 0.95, 0.99, 1.0], "rho": [0.0] * 4, "positions": 100},
        "cost": cost,
    }


def test_goodput_plan_follows_the_context():
    config = AdaptiveSpecConfig.parse(context_config())
    assert config.cost is not None and config.cost.has_context
    assert AdaptiveController(config, DEPTH).plan(1).k > 0  # no context: priced at the tuning contexts (100)
    assert AdaptiveController(config, DEPTH).plan(1, 100.0).k > 0
    assert AdaptiveController(config, DEPTH).plan(1, 4000.0).k == 0  # long context: the verify passes cost more
    ctl = AdaptiveController(config, DEPTH)  # one controller as a generation grows: it leaves speculation
    ks = [ctl.plan(1, 100.0 + 50.0 * i).k for i in range(80)]
    assert ks[0] > 0 and ks[-1] == 0
    policy = ctl.policy
    rates_short, rates_long = policy.rates(policy.states[0], 1, 100.0), policy.rates(policy.states[0], 1, 4000.0)
    assert max(rates_short[1:]) > 1.1 * rates_short[0] and max(rates_long[1:]) < rates_long[0]


def test_cost_config_context_terms_validate():
    assert AdaptiveSpecConfig.parse(context_config()).cost.has_context
    cost = context_config()["cost"]
    base = {k: cost[k] for k in ("batch_sizes", "plain_seconds", "coefficients")}
    assert not CostConfig(**base).has_context
    for bad, words in [
        ({"plain_slope": None}, "plain_slope missing"),
        ({"reference_context": [100.0]}, "reference_context: 2 batch sizes need 2 entries"),
        ({"slope_coefficients": [[1.0, 2.0, 3.0]] * 2}, r"slope_coefficients\[0\]: expected 4 numbers"),
        ({"plain_slope": [-1e-6, 1e-6]}, "greater than or equal to 0"),
        ({"context_slope": [0.0, 0.0]}, "Extra inputs are not permitted"),
    ]:
        with pytest.raises(ValueError, match=words):
            AdaptiveSpecConfig.parse(context_config(bad))
    with pytest.raises(ValueError, match="come together"):
        CostProfile(DEPTH, **{**base, "plain_slope": [0.0, 0.0]})


class RecordingController(OffController):
    """Plain decoding that records what the engine hands to `plan`."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[int, float | None]] = []
        self.remaining: list[list[int] | None] = []

    def plan(self, num_running: int, context: float | None = None, remaining=None):
        self.calls.append((num_running, context))
        self.remaining.append(None if remaining is None else list(remaining))
        return super().plan(num_running, context, remaining)


def test_engine_passes_the_batch_mean_context_to_the_controller():
    engine = make_engine("ouro", max_batch_size=4)
    engine.controller = recorder = RecordingController()
    prompts = [[5, 6, 7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17, 18]]  # 5 and 9 tokens
    engine.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))
    # prefill computes the prompts and samples token 1; each decode round then starts with one more token in KV
    assert recorder.calls == [(2, 7.0), (2, 8.0), (2, 9.0)]


def test_engine_context_reaches_the_goodput_policy():
    engine = make_engine("ouro", speculation="adaptive", max_batch_size=4)
    policy = engine.controller.policy
    seen = []
    select = policy.select

    def record(bucket, batch_size, plan_id, context=None, remaining=None):
        seen.append((batch_size, context))
        return select(bucket, batch_size, plan_id, context, remaining)

    policy.select = record
    engine.generate([[5, 6, 7], [8, 9, 10, 11, 12]], SamplingParams(max_tokens=6, ignore_eos=True))
    assert seen and seen[0] == (2, 4.0)
    assert all(b == 2 and c is not None and c >= 4.0 for b, c in seen)
    assert [c for _, c in seen] == sorted(c for _, c in seen)  # the context only grows


def test_pass_model_slopes_are_recovered_and_kept_non_negative():
    """Slopes a·passes + b·query_passes come back from the cells' slopes; noise cannot make them negative."""
    a, b = 3.0e-7, 2.0e-7
    cells = [(0, 0), *GRID]
    exact = {c: a * passes(*c, DEPTH)[0] + b * passes(*c, DEPTH)[1] for c in cells}
    assert fit_pass_slopes(exact, DEPTH) == pytest.approx((a, b), rel=1e-9)
    assert passes(0, 0, DEPTH) == (4, 4) and passes(4, 3, DEPTH) == (16, 20)
    only_pass = {c: 5e-7 * passes(*c, DEPTH)[0] - 1e-9 * passes(*c, DEPTH)[1] for c in cells}
    got = fit_pass_slopes(only_pass, DEPTH)
    assert got[1] == 0.0 and got[0] > 0.0  # the unconstrained fit would give b < 0
    assert fit_pass_slopes({c: -1.0 for c in cells}, DEPTH) == (0.0, 0.0)


def test_a_slope_measured_loosely_is_replaced_by_the_pass_model():
    """One cell's measured slope of 0 (as tiny-ouro's (4,3) at B = 1 once was) does not survive the fit: its
    slope comes from the model, and its line still goes through its value at the reference context."""
    samples = synthetic_samples(seed=5, noise=0.0, outliers=0.0)
    lines = context_lines(samples)
    ref = 80.0
    broken = {b: dict(row) for b, row in lines.items()}
    a43, s43 = broken[1][(3, 3)]
    broken[1][(3, 3)] = (a43 + s43 * ref, 0.0)  # the same value at ref, no slope
    plain = {b: row[(0, 0)][0] for b, row in lines.items()}
    cells = {b: {c: v[0] for c, v in row.items() if c[0] > 0} for b, row in lines.items()}
    profile = CostProfile.fit(DEPTH, plain, cells, broken, {1: ref, 8: ref})
    slope = profile.predict(3, 3, 1, ref + 100) - profile.predict(3, 3, 1, ref)
    assert slope / 100 == pytest.approx(true_line(1, 3, 3)[1], rel=0.05)


def test_a_line_moved_to_the_model_slope_stays_non_negative():
    """Three cells (the four-feature fit then goes through every cell's intercept) and one of them measured
    with a tiny value and no slope, as a 3-token horizon can: moved to the model's steep slope its intercept
    would go negative, and so would its predictions at short contexts; it is held at 0 instead."""
    cells3 = [(1, 1), (2, 1), (1, 2)]
    lines = {}
    for b in TRUTH:
        lines[b] = {c: true_line(b, *c) for c in [(0, 0), *cells3]}
    lines[1][(2, 1)] = (1e-4, 0.0)
    plain = {b: row[(0, 0)][0] for b, row in lines.items()}
    cells = {b: {c: v[0] for c, v in row.items() if c[0] > 0} for b, row in lines.items()}
    profile = CostProfile.fit(DEPTH, plain, cells, lines, {1: 200.0, 8: 200.0})
    for k, d in [(0, 0), *cells3]:
        for context in (1.0, 40.0):  # at 0 the held line is 0, then clamped to a tiny positive time
            assert profile.predict(k, d, 1, context) > 1e-7, (k, d, context)
