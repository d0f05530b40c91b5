"""Offline tuner: CLI end to end on the fixtures, the written preset, the derivation rules, inputs."""

from __future__ import annotations

import json

import pytest
from conftest import fixture_dir, load

from looped_spec.cli import main
from looped_spec.control.acceptance import markov_accept_rate
from looped_spec.control.costprofile import CostProfile
from looped_spec.control.presets import AdaptiveSpecConfig, load_preset, read_preset_file
from looped_spec.tuning.derive import BucketModel, bucket_ranges, derive_bucket, derive_preset, ideal_seconds
from looped_spec.tuning.inputs import (
    TunerError,
    auto_grid,
    load_prompts,
    parse_adapter_options,
    parse_batch_sizes,
    parse_grid,
)
from looped_spec.tuning.report import dump_json
from looped_spec.tuning.tuner import tune

GRID = "1,1;2,1;1,2"
TINY = ["--batch-sizes", "1,4", "--acceptance-tokens", "6", "--num-prompts", "2", "--profile-tokens", "3"]
TINY += ["--repeats", "1", "--quiet"]
#: A made-up cost profile (seconds) for D = 4 at B = 1 and 4, so the tuner times nothing
PROFILE = {
    "batch_sizes": [1, 4],
    "plain_seconds": [0.004, 0.006],
    "coefficients": [[0.0006, 0.0002, 0.0004, 0.002], [0.001, 0.0003, 0.0009, 0.003]],
}


def test_cli_tune_writes_a_valid_preset_and_heatmap(tmp_path, capsys):
    out, png = tmp_path / "presets" / "ouro-tiny.json", tmp_path / "heat.png"
    argv = ["tune", "--model", str(fixture_dir("ouro")), "--grid", GRID, "--out", str(out), "--heatmap", str(png)]
    # 8 timed tokens, not TINY's 3: over 3 tokens a round's context moves by 2, and the Theil-Sen slope of such
    # a run is noise large enough to pull a pooled intercept below zero (Noticed in the stop-16 note)
    rc = main([*argv, "--hardware", "test-cpu", *TINY, "--profile-tokens", "8"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "B=1:" in printed and "B=4:" in printed and "preset buckets" in printed and "alpha by depth" in printed
    config = read_preset_file(out)
    loaded = load_preset("ouro-tiny", 4, preset=out)
    assert loaded.hardware == "test-cpu" and loaded.full_depth == 4
    assert [(b.min_batch, b.max_batch) for b in config.buckets] == [(1, 2), (3, None)]
    allowed = {(0, 0), (1, 1), (2, 1), (1, 2)}
    for b in config.buckets:
        cands = [(c.k, c.d) for c in b.candidates]
        assert cands[0] == (0, 0) and set(cands) <= allowed and len(cands) >= 2
        assert 0 <= b.initial_index < len(cands)
        for c in b.candidates[1:]:
            assert 0.0 <= c.theta_down <= c.theta_up <= 1.0
    assert config.acceptance is not None and len(config.acceptance.alpha) == 4 and config.acceptance.alpha[3] == 1.0
    assert config.acceptance.positions == 2 * 5  # 2 prompts x (6 tokens - the first, from prefill)
    assert config.cost is not None and config.cost.batch_sizes == [1, 4]
    assert all(t > 0 for t in config.cost.plain_seconds)
    cost = config.cost  # context terms: lines of round seconds in the batch's mean context, per batch size
    assert cost.has_context and len(cost.slope_coefficients) == len(cost.intercept_coefficients) == 2
    assert all(c > 0 for c in cost.reference_context) and all(s >= 0 for s in cost.plain_slope)
    written = json.loads(out.read_text())["cost"]
    assert set(written) == {"batch_sizes", "plain_seconds", "coefficients", "reference_context", "plain_intercept",
                            "plain_slope", "intercept_coefficients", "slope_coefficients"}  # fmt: skip
    prov = config.provenance
    assert isinstance(prov, dict)
    assert prov["command"].startswith("looped-spec tune --model") and prov["model"]["full_depth"] == 4
    assert {"platform", "cpu_count", "torch", "device"} <= set(prov["machine"])
    assert prov["settings"]["grid"] == ["1,1", "2,1", "1,2"] and set(prov["rules"]) >= {"buckets", "thresholds"}
    assert len(prov["prompts"]["fingerprints"]) >= 1
    for b in ("1", "4"):
        cells = prov["cost"][b]
        assert set(cells) == {"0,0", "1,1", "2,1", "1,2"}
        assert all(c["best_run_s"] > 0 and c["cost_s"] > 0 for c in cells.values())
        # --repeats 1: each cell ran once; plain before the first cell and after the last (`repeat_order`)
        assert all(c["runs"] == 1 and c["spread"] == 0.0 for key, c in cells.items() if key != "0,0")
        assert cells["0,0"]["runs"] == 2
        assert all(c["slope_s_per_token"] >= 0 and c["context"] > 0 and c["context_fit_s"] > 0 for c in cells.values())
    assert "us/token x context" in printed
    assert png.is_file() and png.stat().st_size > 1000


def test_cli_tune_usage_errors(tmp_path, capsys):
    out = tmp_path / "nb.json"
    rc = main(["tune", "--model", str(fixture_dir("nanbeige")), "--grid", GRID, "--out", str(out), *TINY])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'1,2'" in err and "d=2" in err and "D=2" in err
    assert not out.exists()
    base = ["tune", "--model", str(fixture_dir("ouro")), "--out", str(out)]
    for flag, value in [("--acceptance-tokens", "1"), ("--profile-tokens", "1"), ("--repeats", "0")]:
        assert main([*base, flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and len(err.strip().splitlines()) == 1
    for old in ("--screen-tokens", "--confirm-tokens"):  # the old screening flags are gone: a usage error
        with pytest.raises(SystemExit) as exc:
            main([*base, old, "1"])
        assert exc.value.code == 2
    assert main(["tune", "--model", str(fixture_dir("ouro")), "--out", str(tmp_path), *TINY]) == 2
    assert "--out" in capsys.readouterr().err


def test_tune_is_deterministic_given_a_cost_profile():
    runs = [
        tune(
            load("ouro"),
            [1, 4],
            "builtin",
            GRID,
            acceptance_tokens=8,
            num_prompts=3,
            cost_profile=PROFILE,
            progress=False,
        )  # fmt: skip
        for _ in range(2)
    ]
    (a, report_a), (b, report_b) = runs
    assert a.model_dump(exclude={"provenance"}) == b.model_dump(exclude={"provenance"})
    assert report_a["acceptance"] == report_b["acceptance"] and report_a["decisions"] == report_b["decisions"]
    assert a.cost is not None and a.cost.plain_seconds == PROFILE["plain_seconds"]
    assert not a.cost.has_context  # a profile without context terms stays one
    assert report_a["settings"]["cost_profile"] == "given" and report_a["cost"] == {}


def test_tune_refuses_when_nothing_was_measured(monkeypatch):
    with pytest.raises(TunerError, match="acceptance_tokens"):
        tune(load("ouro"), [1], "builtin", "1,1", acceptance_tokens=1, cost_profile=PROFILE, progress=False)
    # e.g. every request stopped at its first token: no decode round, nothing drafted or measured
    monkeypatch.setattr(
        "looped_spec.tuning.tuner.measure_match_bits", lambda adapter, prompts, *a: [[[]] * len(prompts)] * 4
    )
    with pytest.raises(TunerError, match="no generated position"):
        tune(load("ouro"), [1], "builtin", "1,1", acceptance_tokens=2, cost_profile=PROFILE, progress=False)


def test_tune_api_on_nanbeige_depth_two():
    profile = {"batch_sizes": [1], "plain_seconds": [0.003], "coefficients": [[0.001, 0.001, 0.0002, 0.001]]}
    config, report = tune(load("nanbeige"), [1, 2], "builtin", "1,1;2,1", acceptance_tokens=6, num_prompts=2,
                          cost_profile=profile, progress=False)  # fmt: skip
    assert isinstance(config, AdaptiveSpecConfig)
    assert [(b.min_batch, b.max_batch) for b in config.buckets] == [(1, 1), (2, None)]
    for b in config.buckets:
        assert [c.k for c in b.candidates][0] == 0 and all(c.d <= 1 for c in b.candidates)
    assert config.provenance == report
    config.validate_for_depth(2)


def test_bucket_ranges_nearest_in_log_space():
    assert bucket_ranges([1, 8, 32]) == [(1, 2), (3, 16), (17, None)]
    assert bucket_ranges([4]) == [(1, None)]
    assert bucket_ranges([2, 1]) == [(1, 1), (2, None)]
    assert bucket_ranges([1, 4, 64]) == [(1, 2), (3, 16), (17, None)]


def _linear_profile_model(alpha, rho=(0.0, 0.0, 0.0, 0.0)) -> BucketModel:
    profile = CostProfile(4, **PROFILE)
    return BucketModel(list(alpha), list(rho), lambda k, d: profile.predict(k, d, 1))


def test_derived_bucket_starts_at_the_fastest_option_and_thresholds_bracket_it():
    model = _linear_profile_model([0.8, 0.9, 0.97, 1.0])
    grid = [(k, d) for k in range(1, 6) for d in range(1, 4)]
    bucket, notes = derive_bucket(model, grid, 1)
    cands = [(c["k"], c["d"]) for c in bucket["candidates"]]
    best = max(grid, key=lambda o: model.speed(o, 1.0))
    assert cands[0] == (0, 0) and cands[bucket["initial_index"]] == best
    assert notes["predicted_ratio"][f"{best[0]},{best[1]}"] == max(notes["predicted_ratio"].values())
    init = bucket["candidates"][bucket["initial_index"]]
    rate = markov_accept_rate(0.8 if best[1] == 1 else model.alpha[best[1] - 1], 0.0, best[0])
    assert init["theta_down"] <= rate <= init["theta_up"]  # at the measured acceptance it stays where it is
    hopeless = _linear_profile_model([0.0, 0.0, 0.0, 1.0])
    bucket, _ = derive_bucket(hopeless, grid, 1)
    assert bucket["initial_index"] == 0 and len(bucket["candidates"]) >= 2  # plain, plus a probe target


def test_derive_preset_from_assumed_numbers_is_valid():
    data = derive_preset("m", 4, [0.7, 0.87, 0.94, 1.0], 64.0)
    config = AdaptiveSpecConfig.parse(data)
    config.validate_for_depth(4)
    assert config.acceptance is not None and config.acceptance.positions == 0
    first = config.buckets[0]
    assert first.candidates[first.initial_index].k > 0  # at B=1 the ideal model speculates
    assert ideal_seconds(4, 1, 64.0)(0, 0) == pytest.approx(4 * (1 + 1 / 64))


def test_grid_and_batch_size_parsing():
    assert auto_grid(4) == [(k, d) for k in range(1, 6) for d in (1, 2, 3)]
    assert sorted({d for _, d in auto_grid(32)}) == [1, 2, 8, 16, 31]
    assert auto_grid(2) == [(k, 1) for k in range(1, 6)]
    assert parse_grid("2,1; 1,2;2,1", 4) == [(2, 1), (1, 2)]
    for bad, words in [("1,4", "d=4"), ("0,1", "K=0"), ("1;2", "'1'"), ("a,b", "'a,b'"), ("", "no entries")]:
        with pytest.raises(TunerError, match=words):
            parse_grid(bad, 4)
    assert parse_batch_sizes("8,1,8") == [1, 8]
    with pytest.raises(TunerError):
        parse_batch_sizes("0,2")
    assert parse_adapter_options(["a=3", "b=zeros", "c=0.5"]) == {"a": 3, "b": "zeros", "c": 0.5}


def test_prompt_sources(tmp_path):
    adapter = load("ouro")
    prompts, what = load_prompts("builtin", adapter, 5)
    assert len(prompts) == 5 and all(isinstance(p, list) for p in prompts) and "random" in what
    assert load_prompts("builtin", adapter, 5)[0] == prompts  # deterministic
    assert load_prompts("tune", adapter, 5)[0] == prompts  # no tokenizer: the same random ids
    text = tmp_path / "p.txt"
    text.write_text("def f(x):\n\n  hello world \n")
    assert load_prompts(str(text), adapter, 3)[0] == ["def f(x):", "  hello world ", "def f(x):"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a\nb"}) + "\n" + json.dumps({"prompt": [5, 6]}) + "\n")
    assert load_prompts(str(jsonl), adapter, 2)[0] == ["a\nb", [5, 6]]
    jsonl.write_text('{"text": 1}\n')
    with pytest.raises(TunerError, match="p.jsonl:1"):
        load_prompts(str(jsonl), adapter, 2)


def test_dump_json():
    data = {"a": [1, 2], "b": {"c": list(range(60))}}
    assert json.loads(dump_json(data)) == data


def test_run_cost_and_monotone_profile():
    from looped_spec.tuning.tuner import nondecreasing, run_cost, trimmed_mean

    assert run_cost([[3.0, 1.0, 2.0], [5.0, 4.0, 6.0]]) == (3.5, 1.5)  # median of run means, their spread
    assert run_cost([[2.0], [9.0], [3.0]])[0] == 3.0  # one disturbed run does not move it
    # ten rounds: the smallest and the largest are dropped (one stalled round does not decide a run's cost)
    assert trimmed_mean([1.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 2.0, 50.0]) == 2.0
    assert trimmed_mean([1.0, 3.0]) == 2.0  # too few rounds to trim
    with pytest.raises(TunerError, match="profile-tokens"):
        run_cost([])
    assert nondecreasing([2.0, 6.0, 4.0, 6.0, 12.0]) == [2.0, 5.0, 5.0, 6.0, 12.0]
    assert nondecreasing([3.0, 1.0, 2.0]) == [2.0, 2.0, 2.0]


def test_cli_tune_cost_from_reuses_a_measured_profile(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    base = ["tune", "--model", str(fixture_dir("ouro")), "--grid", GRID, *TINY]
    assert main([*base, "--out", str(first)]) == 0
    assert main([*base, "--out", str(second), "--cost-from", str(first)]) == 0
    again = tmp_path / "again.json"
    assert main([*base, "--out", str(again), "--cost-from", str(first)]) == 0
    a, b = read_preset_file(first), read_preset_file(second)
    # the same profile gives the same preset; not necessarily the first run's buckets: the written profile is
    # rounded and its context terms refit, which can move a crossing threshold in its last digit
    assert a.acceptance == b.acceptance and b.buckets == read_preset_file(again).buckets
    averaged = ("batch_sizes", "plain_seconds", "coefficients")
    assert all(getattr(a.cost, f) == getattr(b.cost, f) for f in averaged)
    # the context terms are fitted again from the report's per-cell lines (rounded there: 1 us, 4 digits)
    pa, pb = (CostProfile(4, **x.cost.model_dump()) for x in (a, b))
    for k, d in [(0, 0), (1, 1), (2, 3)]:
        for batch, context in [(1, 10.0), (2, 40.0)]:
            assert pb.predict(k, d, batch, context) == pytest.approx(pa.predict(k, d, batch, context), rel=0.02)
    assert b.provenance["cost"] == a.provenance["cost"]  # the timing report travels with the profile
    assert b.provenance["settings"]["cost_profile"].startswith(f"from {first}")
    no_cost = tmp_path / "c.json"
    no_cost.write_text(json.dumps({**json.loads(first.read_text()), "cost": None}))
    assert main([*base, "--out", str(tmp_path / "d.json"), "--cost-from", str(no_cost)]) == 2
    assert "no measured cost profile" in capsys.readouterr().err


def test_round_timer_times_plain_and_speculative_rounds_over_the_same_generated_tokens():
    """Every timed round is full-shape and the rounds cover `horizon` generated tokens per request, whatever K."""
    from looped_spec.tuning.tuner import RoundTimer

    adapter = load("ouro")  # random weights: drafts are (almost) never accepted, one token per round
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    timer = RoundTimer(adapter, max_batch=3, max_model_len=64, warmup=prompts[:1])
    try:
        horizon = 7
        plain = timer.time_rounds((0, 0), prompts, horizon)
        assert len(plain) == horizon - 1  # the first token of each request comes from prefill
        # each round with the batch's mean context at its start: the prompts (4 tokens on average), then +1 a round
        assert [r.context for r in plain] == [4.0 + i for i in range(horizon - 1)]
        spec = timer.time_rounds((2, 1), prompts, horizon)
        engine = timer.engines[(2, 1)]
        assert 1 <= len(spec) <= horizon - 1 and all(r.seconds > 0 for r in spec)
        assert spec[0].context == 4.0 and all(a.context < b.context for a, b in zip(spec, spec[1:]))
        assert engine.stats.num_draft_tokens >= 2 * len(prompts) * len(spec)
        assert not engine.has_unfinished_requests() and engine.num_free_blocks == engine.kv.num_blocks
    finally:
        timer.close()


def test_repeat_order_puts_plain_around_every_cell():
    import random

    from looped_spec.tuning.tuner import PLAIN_EVERY, repeat_order, runs_per_repeat

    cells = [(k, d) for k in (1, 2, 3, 5) for d in (1, 2, 3)]
    order = repeat_order(cells, random.Random(3))
    assert sorted(c for c in order if c[0]) == sorted(cells) and len(order) == runs_per_repeat(len(cells))
    assert order[0] == order[-1] == (0, 0)
    at = [n for n, c in enumerate(order) if c == (0, 0)]
    gaps = [b - a - 1 for a, b in zip(at, at[1:])]
    assert max(gaps) <= PLAIN_EVERY  # at most PLAIN_EVERY cells between two plain runs


def test_drift_correction_recovers_cost_ratios_under_machine_drift():
    """Synthetic repeat: the machine's speed drifts run by run (x0.7 .. x1.4); each run's rounds carry their
    configuration's true cost times the drift. Corrected by the plain runs around it, every cell's ratio to plain
    comes back to within the drift's change between neighbouring runs, where the raw best runs are off by up to
    the drift's whole range."""
    import random

    from looped_spec.tuning.tuner import TimedRound, drift_correct, repeat_order, run_cost

    true = {(0, 0): 1.0, (1, 1): 1.7, (2, 1): 2.1, (3, 2): 2.9, (1, 3): 1.6, (4, 3): 4.3}
    rng = random.Random(0)
    samples = {c: [] for c in true}
    for _ in range(5):
        order = repeat_order([c for c in true if c[0]], rng)
        drift = [1.0]
        for _ in order[1:]:
            drift.append(min(max(drift[-1] * rng.uniform(0.9, 1.1), 0.7), 1.4))  # slow wander
        runs = [[TimedRound(true[c] * f * 1e-3, 50.0)] * 8 for c, f in zip(order, drift)]
        for c, run, g in zip(order, runs, drift_correct(order, runs, 1e-3)):
            samples[c].append([TimedRound(r.seconds * g, r.context) for r in run])
    plain = run_cost([[r.seconds for r in run] for run in samples[(0, 0)]])[0]
    for cell, want in true.items():
        got = run_cost([[r.seconds for r in run] for run in samples[cell]])[0] / plain
        assert abs(got / want - 1.0) < 0.08, (cell, got, want)


def test_acceptance_variants_add_the_plans_uneven_text_needs():
    """The difficulty sweep moves every depth's agreement together; text on which depth 2 agrees far more often
    than the sweep says (0.9 where depth 1 is at 0.5) wants a d = 2 plan that the sweep of this acceptance never
    makes fastest. That text's acceptance as a variant puts the plan among the candidates; the sweep's path stays."""
    from looped_spec.tuning.derive import BucketModel, derive_bucket, ideal_seconds

    grid = [(k, d) for k in (1, 2, 3, 5) for d in (1, 2, 3)]
    seconds = ideal_seconds(4, 1, 8.0)
    alpha, rho = [0.45, 0.6, 0.93, 1.0], [0.0] * 4
    easy_shallow = ([0.5, 0.9, 0.95, 1.0], [0.0] * 4)

    def chain(model):
        data, _ = derive_bucket(model, grid, 1, near=0.0)  # the variants' own contribution
        return [(c["k"], c["d"]) for c in data["candidates"]]

    base = chain(BucketModel(alpha, rho, seconds))
    winner = BucketModel(*easy_shallow, seconds).fastest([(0, 0), *grid], 1.0)
    assert winner[1] == 2 and winner not in base
    with_variant = chain(BucketModel(alpha, rho, seconds, [easy_shallow]))
    assert winner in with_variant and set(base) <= set(with_variant)
    # the EMA ladder stays usable: the inserted plan's thresholds bracket its own acceptance around its place
    # in the order (the first version bisected over the whole sweep and gave such plans [0.03, 0.03])
    data, _ = derive_bucket(BucketModel(alpha, rho, seconds, [easy_shallow]), grid, 1)
    inserted = next(c for c in data["candidates"] if (c["k"], c["d"]) == winner)
    assert 0.2 < inserted["theta_down"] <= inserted["theta_up"]


def test_options_near_the_fastest_are_candidates_though_never_fastest():
    """(1, 1) is never the fastest option anywhere in the difficulty sweep - (2, 1) overtakes plain first - but
    within the measurements' band it comes within 1 % of the fastest: a profile a few percent off decides
    between them, so it is a candidate unless `near` is 0; the cap keeps the options closest to the fastest."""
    seconds = {(0, 0): 1.0, (1, 1): 1.6, (2, 1): 1.9, (5, 1): 40.0}
    model = BucketModel([0.5, 1.0], [0.0, 0.0], lambda k, d: seconds[(k, d)])
    grid = [(1, 1), (2, 1), (5, 1)]
    sweep = [2.0 ** (i / 8) for i in range(-60, 40)]
    assert all(model.fastest([(0, 0), *grid], h) != (1, 1) for h in sweep)

    def chain(**options):
        data, _ = derive_bucket(model, grid, 1, **options)
        return [(c["k"], c["d"]) for c in data["candidates"]]

    assert chain(near=0.0) == [(0, 0), (2, 1)]
    assert chain()[0] == (0, 0) and set(chain()) == {(0, 0), (1, 1), (2, 1)}
    assert chain(max_candidates=2) == [(0, 0), (2, 1)]  # (2, 1) is the fastest in the band; (1, 1) only near
    # independently of the rules' sweep: every option within 6 % of the fastest at the measured acceptance
    tuned = _linear_profile_model([0.7, 0.85, 0.95, 1.0], [0.3, 0.2, 0.1, 0.0])
    grid4 = [(k, d) for k in range(1, 6) for d in range(1, 4)]
    data, _ = derive_bucket(tuned, grid4, 1)
    cands = {(c["k"], c["d"]) for c in data["candidates"]}
    top = max(tuned.speed(o, 1.0) for o in [(0, 0), *grid4])
    assert {o for o in grid4 if tuned.speed(o, 1.0) >= 0.94 * top} <= cands
    # the cap keeps the options that come closest to the fastest near the measured acceptance, whatever their order
    from looped_spec.tuning.derive import NEAR_BAND

    def closeness(option):
        hs = [NEAR_BAND ** (i / 20) for i in range(-20, 21)]
        return max(tuned.speed(option, h) / max(tuned.speed(o, h) for o in [(0, 0), *grid4]) for h in hs)

    full = [(c["k"], c["d"]) for c in data["candidates"]][1:]
    capped, _ = derive_bucket(tuned, grid4, 1, max_candidates=4)
    kept = [(c["k"], c["d"]) for c in capped["candidates"]][1:]
    assert len(kept) == 3 and set(kept) <= set(full) and kept == [o for o in full if o in kept]
    assert min(closeness(o) for o in kept) >= max(closeness(o) for o in full if o not in kept) - 0.01


def test_acceptance_variants_sample_batches_of_tuning_prompts():
    from looped_spec.tuning.tuner import acceptance_variants

    bits = [[[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], [[1, 1, 1, 1]] * 3]  # [depth][prompt][position]
    variants = acceptance_variants(bits, 1, count=20)
    assert len(variants) == 20 and {v[0][0] for v in variants} == {0.75, 0.0, 1.0}  # each prompt alone
    assert all(v[0][1] == 1.0 for v in variants)
    assert acceptance_variants(bits, 3) == []  # a batch of every prompt is the base acceptance itself
    assert acceptance_variants(bits, 2, seed=4) == acceptance_variants(bits, 2, seed=4)
