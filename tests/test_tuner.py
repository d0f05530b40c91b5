"""The offline tuner: acceptance pass, pass-cost profile, derivation rules, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from conftest import fixture_dir, load

from looped_spec import load_adapter
from looped_spec.cli import main
from looped_spec.control import AdaptiveController
from looped_spec.control.acceptance import accept_rate
from looped_spec.control.passcost import PassCost
from looped_spec.control.plan import round_feedback
from looped_spec.presets import AdaptiveSpecConfig, load_preset, read_preset_file
from looped_spec.presets.schema import CostConfig
from looped_spec.tuning import profile
from looped_spec.tuning.derive import (
    BucketModel,
    bucket_ranges,
    derive_bucket,
    derive_buckets,
    derive_preset,
    ideal_cost,
    pass_seconds,
)
from looped_spec.tuning.grid import auto_grid, parse_batch_sizes, parse_grid
from looped_spec.tuning.inputs import TunerError, parse_adapter_options
from looped_spec.tuning.profile import TRUSTED_ERROR, validation_summary
from looped_spec.tuning.prompt_sets import load_prompts
from looped_spec.tuning.report import dump_json, format_report
from looped_spec.tuning.tuner import tune

GRID = "1,1;2,1;1,2"
TINY = ["--batch-sizes", "1,4", "--acceptance-tokens", "6", "--num-prompts", "2", "--round-tokens", "4"]
TINY += ["--repeats", "1", "--quiet"]
#: A made-up pass-cost profile, so the tuner times nothing
PROFILE = ideal_cost(16)


def test_cli_tune_writes_a_valid_preset_and_heatmap(tmp_path, capsys):
    out, png = tmp_path / "presets" / "ouro-tiny.json", tmp_path / "heat.png"
    argv = ["tune", "--model", str(fixture_dir("ouro")), "--grid", GRID, "--out", str(out), "--heatmap", str(png)]
    rc = main([*argv, "--hardware", "test-cpu", "--log-level", "info", *TINY])
    assert rc == 0
    captured = capsys.readouterr()
    printed = captured.out
    assert "[looped_spec.engine.engine] engine: " in captured.err  # --log-level info: the engine's startup line
    assert "pass-cost profile against" in printed and "preset buckets" in printed and "alpha by depth" in printed
    config = read_preset_file(out)
    loaded = load_preset("ouro-tiny", 4, preset=out)
    assert loaded.hardware == "test-cpu" and loaded.full_depth == 4 and loaded.model_type == "ouro"
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
    cost = config.cost
    assert cost.positions == sorted(cost.positions) and all(w >= 0 for w in cost.pass_seconds)
    assert cost.pass_seconds == sorted(cost.pass_seconds)  # a wider pass never costs less
    assert PassCost(cost, 4).predict(0, 0, 1, 20.0) > 0
    prov = config.provenance
    assert isinstance(prov, dict)
    assert prov["command"].startswith("looped-spec tune --model") and prov["model"]["full_depth"] == 4
    assert {"platform", "cpu_count", "torch", "device"} <= set(prov["machine"])
    assert prov["settings"]["grid"] == ["1,1", "2,1", "1,2"] and set(prov["rules"]) >= {"buckets", "thresholds"}
    assert len(prov["prompts"]["fingerprints"]) >= 1
    report = prov["cost"]
    assert report["steps_timed"] > 0 and report["rounds_timed"] > 0
    # the profile checked against the rounds it was fitted to: plain decoding is its own reference at each B
    assert report["validation"]["0,0@1"]["relative_to_plain"] == 1.0
    assert all(cell["measured_over_predicted"] > 0 and cell["rounds"] >= 3 for cell in report["validation"].values())
    summary = report["validation_summary"]  # the speculative cells' error against plain, summed up (None: no cell)
    errors = {k: abs(c["relative_to_plain"] - 1) for k, c in report["validation"].items() if not k.startswith("0,")}
    assert (summary is None) == (not errors)
    if errors:
        assert summary["worst_cell"] in errors and summary["max_error"] == pytest.approx(max(errors.values()), abs=1e-4)
    assert png.is_file() and png.stat().st_size > 1000


def test_a_model_of_few_positions_is_timed_at_contexts_that_fit_it(tmp_path):
    """The timed steps prefilled requests of up to 225 tokens whatever the model: tuning a model of 160 positions failed
    after its acceptance pass with 'prompt has 175 tokens; max_model_len=160 leaves no room to generate', about a
    prompt no one gave. Its steps are now timed at contexts it has room for."""
    import shutil

    folder = tmp_path / "ouro-short"
    shutil.copytree(fixture_dir("ouro"), folder)
    config = json.loads((folder / "config.json").read_text())
    config["max_position_embeddings"] = 160
    (folder / "config.json").write_text(json.dumps(config))
    adapter = load_adapter(folder)
    steps = profile.measure_steps(adapter, repeats=1)
    assert steps and max(s["context"] for s in steps) + max(s["positions"] for s in steps) < 160
    assert profile.step_contexts(512) == sorted(profile.CONTEXTS)  # a model with room is timed as before


def test_validation_summary_judges_plans_against_plain():
    """The median and worst error of the speculative cells' price relative to plain (plain cells are their own
    reference, so they are left out), and whether the worst is within the trusted error."""
    cell = lambda rel: {"measured_over_predicted": 1.1, "relative_to_plain": rel, "rounds": 9}  # noqa: E731
    validation = {"0,0@1": cell(1.0), "1,1@1": cell(0.97), "3,1@1": cell(1.04), "0,0@8": cell(1.0), "3,1@8": cell(1.2)}
    summary = validation_summary(validation)
    assert summary == {"median_error": 0.04, "max_error": 0.2, "worst_cell": "3,1@8", "trusted": False}
    validation["3,1@8"] = cell(1.0 - TRUSTED_ERROR / 2)
    assert validation_summary(validation)["trusted"]
    assert validation_summary({"0,0@1": cell(1.0)}) is None


@pytest.mark.slow
def test_the_tuner_warns_when_its_profile_misprices_its_own_rounds(monkeypatch, caplog):
    """A profile whose prices of plans against plain are off its own timed rounds by more than the trusted error (a
    machine whose speed moved while it was timed) is written, with a warning naming the worst cell, and the report
    says so; within it, no warning."""
    from looped_spec.tuning import tuner

    adapter = load("ouro")
    prompts = [[5, 6, 7, 8]] * 2

    def timed_once(measure):
        """`measure`, its first result kept: both skews below price the same timed steps and rounds (the skew, not
        the timing, decides the warning), timed once."""
        kept = []

        def measure_once(*args):
            if not kept:
                kept.append(measure(*args))
            return kept[0]

        return measure_once

    with monkeypatch.context() as patched:
        patched.setattr(profile, "measure_steps", timed_once(profile.measure_steps))
        patched.setattr(profile, "measure_rounds", timed_once(profile.measure_rounds))
        for skew, warned in ((1.3, True), (1.02, False)):
            real = profile.validate

            def skewed(cost_data, rounds, depth, skew=skew, real=real):
                out = real(cost_data, rounds, depth)
                for key, cell in out.items():
                    if not key.startswith("0,"):
                        cell["relative_to_plain"] = skew
                return out

            patched.setattr(profile, "validate", skewed)
            caplog.clear()
            with caplog.at_level("WARNING", logger="looped_spec.tuning"):
                _, report = tuner.measure_cost(adapter, prompts, [1], repeats=2, round_tokens=16)
            told = [r.getMessage() for r in caplog.records if "pass-cost profile" in r.getMessage()]
            assert report["validation_summary"]["trusted"] is not warned
            assert len(told) == int(warned), told
            if warned:
                assert "30% off" in told[0] and report["validation_summary"]["worst_cell"] in told[0]
                empty = {"positions": 0, "alpha": [], "rho": [], "cells": {}}
                assert "time it again" in format_report({"acceptance": empty, "cost": report})
    # no speculative cell to check (too few rounds of each plan): said, not passed over
    plain_only = {"0,0@1": {"measured_over_predicted": 1.0, "relative_to_plain": 1.0, "rounds": 3}}
    monkeypatch.setattr(profile, "validate", lambda cost_data, rounds, depth: plain_only)
    caplog.clear()
    with caplog.at_level("WARNING", logger="looped_spec.tuning"):
        _, report = tuner.measure_cost(adapter, prompts, [1], repeats=1, round_tokens=4)
    assert report["validation_summary"] is None
    assert any("were not checked: no speculative plan ran 3 timed rounds" in r.getMessage() for r in caplog.records)
    empty = {"positions": 0, "alpha": [], "rho": [], "cells": {}}
    assert "plans against plain: not checked" in format_report({"acceptance": empty, "cost": report})


def test_cli_tune_usage_errors(tmp_path, capsys):
    out = tmp_path / "nb.json"
    rc = main(["tune", "--model", str(fixture_dir("nanbeige")), "--grid", GRID, "--out", str(out), *TINY])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'1,2'" in err and "d=2" in err and "D=2" in err
    assert not out.exists()
    base = ["tune", "--model", str(fixture_dir("ouro")), "--out", str(out)]
    for flag, value in [("--acceptance-tokens", "1"), ("--round-tokens", "1"), ("--repeats", "0")]:
        assert main([*base, flag, value]) == 2
        err = capsys.readouterr().err
        assert flag in err and len(err.strip().splitlines()) == 1
    for old in ("--profile-tokens", "--screen-tokens"):  # flags of earlier tuners are usage errors, not shrugs
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
    assert a.cost == CostConfig.model_validate(PROFILE)
    assert report_a["settings"]["cost_profile"] == "given" and report_a["cost"] == {}


def test_tune_refuses_when_nothing_was_measured(monkeypatch):
    with pytest.raises(TunerError, match="acceptance_tokens"):
        tune(load("ouro"), [1], "builtin", "1,1", acceptance_tokens=1, cost_profile=PROFILE, progress=False)
    with pytest.raises(TunerError, match="hardware='': is empty"):  # the CLI refuses it; tune() took the device's
        tune(load("ouro"), [1], "builtin", "1,1", hardware=" ", cost_profile=PROFILE, progress=False)
    # e.g. every request stopped at its first token: no decode round, nothing drafted or measured
    monkeypatch.setattr(
        "looped_spec.tuning.tuner.measure_match_bits", lambda adapter, prompts, *a: [[[]] * len(prompts)] * 4
    )
    with pytest.raises(TunerError, match="no generated position"):
        tune(load("ouro"), [1], "builtin", "1,1", acceptance_tokens=2, cost_profile=PROFILE, progress=False)


def test_tune_api_on_nanbeige_depth_two():
    config, report = tune(load("nanbeige"), [1, 2], "builtin", "1,1;2,1", acceptance_tokens=6, num_prompts=2,
                          cost_profile=PROFILE, progress=False)  # fmt: skip
    assert isinstance(config, AdaptiveSpecConfig)
    assert [(b.min_batch, b.max_batch) for b in config.buckets] == [(1, 1), (2, None)]
    for b in config.buckets:
        assert [c.k for c in b.candidates][0] == 0 and all(c.d <= 1 for c in b.candidates)
    assert config.provenance == report
    assert config.for_depth(2) == (config, None)


def test_tune_takes_adapter_options_and_records_them():
    """Huginn at another test-time depth is tuned as that model (its acceptance measured at that depth)."""
    config, report = tune(str(fixture_dir("huginn")), [1], "builtin", "1,1", acceptance_tokens=4, num_prompts=1,
                          cost_profile=PROFILE, adapter_options={"num_steps": 3}, progress=False)  # fmt: skip
    assert config.full_depth == 3 and len(config.acceptance.alpha) == 3
    assert report["model"]["adapter_options"] == {"num_steps": 3}
    # a loaded adapter brings its own options, recorded as it runs; loading options beside it are errors
    loaded = load_adapter(fixture_dir("huginn"), num_steps=3)
    config, report = tune(loaded, [1], "builtin", "1,1", acceptance_tokens=4, num_prompts=1, cost_profile=PROFILE,
                          progress=False)  # fmt: skip
    assert config.full_depth == 3 and report["model"]["adapter_options"] == {"num_steps": 3}
    for option in ({"adapter_options": {"num_steps": 4}}, {"dtype": "bfloat16"}, {"device": "cpu"}):
        with pytest.raises(TunerError, match=f"{next(iter(option))}=.*not for a loaded ModelAdapter"):
            tune(loaded, [1], "builtin", "1,1", cost_profile=PROFILE, progress=False, **option)


def test_tune_takes_a_numpy_depth_and_records_it_as_json_can():
    """A sweep's numpy integer is a depth like any int, and the preset it writes records it as an int (JSON)."""
    config, report = tune(str(fixture_dir("huginn")), [1], "builtin", "1,1", acceptance_tokens=4, num_prompts=1,
                          cost_profile=PROFILE, adapter_options={"num_steps": np.int64(3)}, progress=False)  # fmt: skip
    assert config.full_depth == 3
    assert json.loads(json.dumps(report["model"]["adapter_options"])) == {"num_steps": 3}
    with pytest.raises(TunerError, match="adapter_options: a dict .* got str"):
        tune(str(fixture_dir("huginn")), [1], "builtin", "1,1", adapter_options="num_steps=3", cost_profile=PROFILE,
             progress=False)  # fmt: skip


def test_profile_fit_recovers_a_known_profile_from_its_own_timings():
    """Independent reference: timings made from a known profile (the same feature counts, plus 3 % noise) fit back
    to predictions within a few percent of that profile's, for plans and batch sizes the fit never saw."""
    from looped_spec.control.plan import SpeculationPlan, round_feedback
    from looped_spec.tuning import profile as tuning_profile

    truth = PassCost(CostConfig.model_validate(KNOWN_PROFILE), 4)
    rng = np.random.default_rng(0)
    steps = []
    for r in tuning_profile.REQUESTS:
        for q in tuning_profile.QUERIES:
            for context in (16.0, 200.0):
                for loops, readout, embeds in ((1, False, True), (3, False, True), (1, True, True), (1, False, False)):
                    n = r * q
                    row = loops * truth.pass_features(r, n, context)[0] + truth.step_features(r, n, float(embeds))[0]
                    row = row + (truth.readout_features(n)[0] if readout else 0.0)
                    seconds = (
                        1.3 * float(row @ truth.theta) * float(np.exp(rng.normal(0, 0.03)))
                    )  # another machine state
                    steps.append({"requests": r, "positions": q, "loops": loops, "readout": readout,
                                  "embeds": embeds, "context": context, "seconds": seconds})  # fmt: skip
    rounds = []
    for k, d in [(0, 0), (1, 1), (3, 1), (2, 2), (5, 2), (3, 3)]:
        for b in (1, 4, 16, 32):
            for context in (80.0, 140.0):
                features = truth.features([k], [d], b, context)[0]
                inside = float(features[:-5] @ truth.theta[:-5])
                noise = float(np.exp(rng.normal(0, 0.03)))
                plan = SpeculationPlan(0, k, d)
                fb = round_feedback(plan, batch_size=b, context=context, num_proposed=[k] * b, num_accepted=[0] * b,
                                    seconds=float(features @ truth.theta) * noise)  # fmt: skip
                rounds.append((fb, inside * noise))
    fitted = PassCost(CostConfig.model_validate(tuning_profile.fit_profile(4, steps, rounds)), 4)
    for k, d in [(0, 0), (2, 1), (4, 2), (4, 3)]:
        for b in (2, 8, 24):
            want = float(truth.profile_seconds([k], [d], b, 110.0)[0])
            assert float(fitted.profile_seconds([k], [d], b, 110.0)[0]) == pytest.approx(want, rel=0.06), (k, d, b)


#: A known pass-cost profile, every term non-zero and the pass curve rising (the fit keeps it non-decreasing)
KNOWN_PROFILE = {
    "positions": list(profile.WIDTHS), "pass_seconds": [4e-4 + 1.5e-5 * n for n in profile.WIDTHS],
    "request_seconds": 1e-5, "request_context_seconds": 5e-7, "query_context_seconds": 1e-8,
    "step_seconds": [1e-4, 2e-6, 1e-6], "embed_seconds": [2e-5, 1e-7], "readout_seconds": [6e-5, 2e-6],
    "round_seconds": [1.5e-4, 1.5e-5], "speculative_seconds": [3e-4, 4e-5, 5e-6],
}  # fmt: skip


def _known_steps(truth: PassCost, scale: float = 1.0, stalled: int = 0) -> list[dict]:
    """Every step shape and kind `measure_steps` times, timed exactly as `truth` prices it (times `scale`: another
    machine state); every `stalled`-th one (if any) 5 times slower, as a stalled step."""
    steps = []
    kinds = ((1, False, True), (3, False, True), (1, True, True), (1, False, False))
    for r in profile.REQUESTS:
        for q in profile.QUERIES:
            for context in (16.0, 200.0):
                for loops, readout, embeds in kinds:
                    n = r * q
                    row = loops * truth.pass_features(r, n, context)[0] + truth.step_features(r, n, float(embeds))[0]
                    row = row + (truth.readout_features(n)[0] if readout else 0.0)
                    seconds = scale * float(row @ truth.theta)
                    if stalled and len(steps) % stalled == stalled - 1:
                        seconds *= 5.0
                    steps.append({"requests": r, "positions": q, "loops": loops, "readout": readout,
                                  "embeds": embeds, "context": context, "seconds": seconds})  # fmt: skip
    return steps


def _known_round(truth: PassCost, k: int, d: int, b: int, context: float, proposed=None, factor: float = 1.0):
    """(feedback, seconds inside the runner) of a round of plan (k, d) in which the requests drafted `proposed`
    (default: k each), timed as `truth` prices a round of the fewest drafts they made (a draining round is cheaper
    than its plan), times `factor`."""
    from looped_spec.control.plan import SpeculationPlan

    proposed = [k] * b if proposed is None else proposed
    ran = min(proposed)
    features = truth.features([ran], [d if ran else 0], b, context)[0]
    inside = float(features[:-5] @ truth.theta[:-5]) * factor
    fb = round_feedback(SpeculationPlan(0, k, d), batch_size=b, context=context, num_proposed=proposed,
                        num_accepted=[0] * b, seconds=float(features @ truth.theta) * factor)  # fmt: skip
    return fb, inside


def test_profile_fit_from_steps_alone_recovers_every_step_coefficient():
    """Steps timed exactly from a known profile fit back to its coefficients (to the 4 digits a profile keeps): the
    loops, the readout and the embedding of each step counted, and each written to its own field."""
    truth = PassCost(CostConfig.model_validate(KNOWN_PROFILE), 4)
    fitted = profile.fit_profile(4, _known_steps(truth), [])
    for field in ("pass_seconds", "request_seconds", "request_context_seconds", "query_context_seconds",
                  "step_seconds", "embed_seconds", "readout_seconds"):  # fmt: skip
        assert fitted[field] == pytest.approx(KNOWN_PROFILE[field], rel=2e-3), field
    # the outside terms only rounds show
    assert fitted["round_seconds"] == [0.0, 0.0] and fitted["speculative_seconds"] == [0.0, 0.0, 0.0]


def test_profile_fit_prices_full_rounds_exactly_past_stalls_draining_rounds_and_the_steps_machine_state():
    """Rounds timed exactly from a known profile, with what real timings bring: steps timed 1.3 times slower (another
    machine state, which the fit's own scale factor for the steps absorbs), a few stalled steps and rounds (which the
    robust reweighting leaves out), and rounds near requests' ends that drafted fewer tokens than their plan (cheaper
    than its price: left out). The fitted profile prices the rounds as the known one does, for plans and batch sizes
    it never saw, inside the runner and outside it, within 0.5 % (the profile keeps 4 digits; with the scale factor
    stopped after 4 alternations it was 1.2 % off, and without the factor, the reweighting or leaving the draining
    rounds out 5 % or more)."""
    truth = PassCost(CostConfig.model_validate(KNOWN_PROFILE), 4)
    rounds = []
    for k, d in [(0, 0), (1, 1), (3, 1), (2, 2), (5, 2), (3, 3)]:
        for b in (1, 4, 16, 32):
            for context in (80.0, 140.0):
                rounds.append(_known_round(truth, k, d, b, context))
                if k:  # the last rounds of a request: one request, or all of them, drafts less
                    rounds.append(_known_round(truth, k, d, b, context, [k] * (b - 1) + [k - 1]))
                    rounds.append(_known_round(truth, k, d, b, context, [0] * b))
        rounds.append(_known_round(truth, k, d, 4, 80.0, factor=4.0))  # a stalled round
    fitted = PassCost(CostConfig.model_validate(profile.fit_profile(4, _known_steps(truth, 1.3, 41), rounds)), 4)
    for k, d in [(0, 0), (2, 1), (4, 2), (4, 3)]:
        for b in (2, 8, 24):
            want = float(truth.profile_seconds([k], [d], b, 110.0)[0])
            assert float(fitted.profile_seconds([k], [d], b, 110.0)[0]) == pytest.approx(want, rel=0.005), (k, d, b)


def test_profile_validation_cells_are_full_shape_rounds_against_plain_at_their_batch_size():
    """`validate`'s cells from rounds timed as a known profile's prices times a factor: the machine 1.2 times slower
    than the profile, speculative rounds a further 1.1 (so 1.32 against the profile, 1.1 against plain), the median
    of each cell's rounds passing over a stalled one (plain's too); rounds that drafted fewer tokens than their plan
    left out; a cell of fewer than 3 rounds, or with no plain cell at its batch size, not reported."""
    truth = PassCost(CostConfig.model_validate(KNOWN_PROFILE), 4)
    rounds = [_known_round(truth, 0, 0, 4, c, factor=f) for c, f in ((50.0, 1.2), (60.0, 1.2), (70.0, 1.2), (90.0, 4))]
    rounds += [_known_round(truth, 2, 1, 4, c, factor=1.32) for c in (50.0, 60.0, 70.0)]
    rounds.append(_known_round(truth, 2, 1, 4, 90.0, factor=3.0))  # a stalled round: the median passes over it
    rounds += [_known_round(truth, 2, 1, 4, 80.0, [2, 2, 2, 1], factor=3.0) for _ in range(3)]  # draining
    rounds += [_known_round(truth, 2, 1, 4, 80.0, [0] * 4, factor=3.0) for _ in range(3)]  # drafted nothing
    rounds += [_known_round(truth, 3, 1, 4, c, factor=1.32) for c in (50.0, 60.0)]  # 2 rounds only
    rounds += [_known_round(truth, 2, 1, 8, c, factor=1.32) for c in (50.0, 60.0, 70.0)]  # no plain at 8
    cells = profile.validate(KNOWN_PROFILE, rounds, 4)
    assert cells == {
        "0,0@4": {"measured_over_predicted": 1.2, "relative_to_plain": 1.0, "rounds": 4},
        "2,1@4": {"measured_over_predicted": 1.32, "relative_to_plain": 1.1, "rounds": 4},
    }


def test_bucket_ranges_nearest_in_log_space():
    assert bucket_ranges([1, 8, 32]) == [(1, 2), (3, 16), (17, None)]
    assert bucket_ranges([4]) == [(1, None)]
    assert bucket_ranges([2, 1]) == [(1, 1), (2, None)]
    assert bucket_ranges([1, 4, 64]) == [(1, 2), (3, 16), (17, None)]


def _linear_profile_model(alpha, rho=(0.0, 0.0, 0.0, 0.0)) -> BucketModel:
    cost = PassCost(CostConfig.model_validate(PROFILE), 4)
    return BucketModel(list(alpha), list(rho), pass_seconds(cost, 1, 50.0))


def test_derived_bucket_starts_at_the_fastest_option_and_thresholds_bracket_it():
    model = _linear_profile_model([0.8, 0.9, 0.97, 1.0])
    grid = [(k, d) for k in range(1, 6) for d in range(1, 4)]
    bucket, notes = derive_bucket(model, grid, 1)
    cands = [(c["k"], c["d"]) for c in bucket["candidates"]]
    best = max(grid, key=lambda o: model.speed(o, 1.0))
    assert cands[0] == (0, 0) and cands[bucket["initial_index"]] == best
    assert notes["predicted_ratio"][f"{best[0]},{best[1]}"] == max(notes["predicted_ratio"].values())
    init = bucket["candidates"][bucket["initial_index"]]
    rate = float(accept_rate(0.8 if best[1] == 1 else model.alpha[best[1] - 1], 0.0, best[0]))
    assert init["theta_down"] <= rate <= init["theta_up"]  # at the measured acceptance it stays where it is
    hopeless = _linear_profile_model([0.0, 0.0, 0.0, 1.0])
    bucket, _ = derive_bucket(hopeless, grid, 1)
    assert bucket["initial_index"] == 0 and len(bucket["candidates"]) >= 2  # plain, plus a probe target


def test_a_bucket_where_nothing_pays_keeps_the_ema_policy_off_at_the_measured_acceptance():
    """Where no option ever beats plain (every draft costs more than it can commit), the bucket keeps one option as
    the probe target; its off threshold is its acceptance where it comes closest to paying, so a probe on the measured
    text fails and speculation stays off (the mutation check, the target placed at the hardest text: theta_down 0,
    and the first probe switched speculation on for good)."""
    alpha = [0.5, 0.6, 0.7, 1.0]
    model = BucketModel(alpha, [0.0] * 4, lambda k, d: 1.01 * (k + 1) if k else 1.0)
    grid = [(k, d) for k in range(1, 4) for d in range(1, 4)]
    buckets, disable, _ = derive_buckets({8: model}, grid)
    cfg = AdaptiveSpecConfig.parse({
        "model": "m", "full_depth": 4, "buckets": buckets, "disable": disable,
        "acceptance": {"alpha": alpha, "rho": [0.0] * 4, "positions": 100}, "cost": PROFILE,
    })  # fmt: skip
    controller = AdaptiveController(cfg, 4, policy="ema")
    rng, speculative = np.random.default_rng(0), 0
    for _ in range(300):  # every draft at depth d accepted with the measured probability alpha[d - 1]
        plan = controller.plan(8, 50.0)
        accepted = [sum(1 for _ in range(plan.k) if rng.random() < alpha[plan.d - 1]) for _ in range(8)]
        speculative += plan.k > 0
        controller.observe(round_feedback(plan, batch_size=8, context=50.0, num_proposed=[plan.k] * 8,
                                          num_accepted=accepted, seconds=0.0))  # fmt: skip
    assert speculative <= 20, speculative  # the probes alone


def test_derive_preset_from_assumed_numbers_is_valid():
    data = derive_preset("m", 4, [0.7, 0.87, 0.94, 1.0], 64.0)
    config = AdaptiveSpecConfig.parse(data)
    assert config.full_depth == 4
    assert config.acceptance is not None and config.acceptance.positions == 0
    first = config.buckets[0]
    assert first.candidates[first.initial_index].k > 0  # at B=1 the ideal model speculates
    plain = PassCost(config.cost, 4).profile_seconds([0], [0], 1, 0.0)[0]
    assert plain == pytest.approx(1e-3 * (4 * (1 + 1 / 64) + 0.08 * (1 + 1 / 64)))  # D passes and one readout


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
    prompts, what = load_prompts("builtin", 5, adapter, purpose="tune")
    assert len(prompts) == 5 and all(isinstance(p, list) for p in prompts) and "random" in what
    assert load_prompts("builtin", 5, adapter, purpose="tune")[0] == prompts  # deterministic
    assert load_prompts("tune", 5, adapter, purpose="tune")[0] == prompts  # no tokenizer: the same random ids
    text = tmp_path / "p.txt"
    text.write_text("def f(x):\n\n  hello world \n")
    with pytest.raises(TunerError, match="no tokenizer, so its prompts must be token ids"):  # the engine would refuse
        load_prompts(str(text), 3, adapter, purpose="tune")
    with_tokenizer = load_adapter("tiny-ouro")
    assert load_prompts(str(text), 3, with_tokenizer, purpose="tune")[0] == ["def f(x):", "  hello world ", "def f(x):"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a\nb"}) + "\n" + json.dumps({"prompt": [5, 6]}) + "\n")
    assert load_prompts(str(jsonl), 2, with_tokenizer, purpose="tune")[0] == ["a\nb", [5, 6]]
    jsonl.write_text(json.dumps({"prompt": [5, 6]}) + "\n")
    assert load_prompts(str(jsonl), 2, adapter, purpose="tune")[0] == [[5, 6], [5, 6]]
    jsonl.write_text('{"text": 1}\n')
    with pytest.raises(TunerError, match="p.jsonl:1"):
        load_prompts(str(jsonl), 2, adapter, purpose="tune")


def test_dump_json():
    data = {"a": [1, 2], "b": {"c": list(range(60))}}
    assert json.loads(dump_json(data)) == data


def test_cli_tune_cost_from_reuses_a_measured_profile(tmp_path, capsys):
    first, second = tmp_path / "a.json", tmp_path / "b.json"
    base = ["tune", "--model", str(fixture_dir("ouro")), "--grid", GRID, *TINY]
    assert main([*base, "--out", str(first)]) == 0
    timing = {"--round-tokens", "--repeats"}  # they time rounds: dropped with their values
    untimed = [f for i, f in enumerate(base) if f not in timing and (i == 0 or base[i - 1] not in timing)]
    assert main([*base, "--out", str(second), "--cost-from", str(first)]) == 2
    assert "--round-tokens: times rounds, which --cost-from skips" in capsys.readouterr().err
    base = untimed
    assert main([*base, "--out", str(second), "--cost-from", str(first)]) == 0
    a, b = read_preset_file(first), read_preset_file(second)
    assert a.acceptance == b.acceptance and a.cost == b.cost and a.buckets == b.buckets
    assert b.provenance["cost"] == a.provenance["cost"]  # the timing report travels with the profile
    assert b.provenance["settings"]["cost_profile"].startswith(f"from {first}")
    no_cost = tmp_path / "c.json"
    no_cost.write_text(json.dumps({**json.loads(first.read_text()), "cost": None}))
    assert main([*base, "--out", str(tmp_path / "d.json"), "--cost-from", str(no_cost)]) == 2
    assert "c.json: cost" in capsys.readouterr().err


def test_acceptance_variants_add_the_plans_uneven_text_needs():
    """The difficulty sweep moves every depth's agreement together; text on which depth 2 agrees far more often
    than the sweep says (0.9 where depth 1 is at 0.5) wants a d = 2 plan that the sweep of this acceptance never
    makes fastest. That text's acceptance as a variant puts the plan among the candidates; the sweep's path stays."""
    from looped_spec.tuning.derive import BucketModel, derive_bucket

    grid = [(k, d) for k in (1, 2, 3, 5) for d in (1, 2, 3)]
    seconds = pass_seconds(PassCost(CostConfig.model_validate(ideal_cost(8.0)), 4), 1, 0.0)
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


def test_the_cap_on_candidates_keeps_the_fastest_option_at_the_measured_acceptance():
    """(2, 1) is the fastest option at the measured acceptance (it first wins at h = 3); (3, 1) overtakes it just
    below h = 1, so it is as close to the fastest in the band and placed nearer h = 1. A cap of one speculative
    candidate kept (3, 1) alone, and the bucket started at plain where its rules predict (2, 1) pays 1.56x."""
    seconds = {(0, 0): 1.0, (1, 1): 10.0, (2, 1): 1.56, (3, 1): 1.8962}
    model = BucketModel([0.8, 1.0], [0.0, 0.0], lambda k, d: seconds[(k, d)])
    grid = [(1, 1), (2, 1), (3, 1)]
    assert model.fastest([(0, 0), *grid], 1.0) == (2, 1)
    for cap in (2, 3, 10):
        data, _ = derive_bucket(model, grid, 1, max_candidates=cap)
        cands = [(c["k"], c["d"]) for c in data["candidates"]]
        assert len(cands) <= cap and cands[data["initial_index"]] == (2, 1), (cap, cands)


def test_acceptance_variants_sample_batches_of_tuning_prompts():
    from looped_spec.tuning.acceptance_pass import acceptance_variants

    bits = [[[1, 1, 0, 1], [0, 0, 0, 0], [1, 1, 1, 1]], [[1, 1, 1, 1]] * 3]  # [depth][prompt][position]
    variants = acceptance_variants(bits, 1, count=20)
    assert len(variants) == 20 and {v[0][0] for v in variants} == {0.75, 0.0, 1.0}  # each prompt alone
    assert all(v[0][1] == 1.0 for v in variants)
    assert acceptance_variants(bits, 3) == []  # a batch of every prompt is the base acceptance itself
    assert acceptance_variants(bits, 2, seed=4) == acceptance_variants(bits, 2, seed=4)


def test_cli_tune_cost_from_keeps_the_profiles_hardware_and_machine(tmp_path):
    """The cost section is the source preset's measurement: the new preset keeps its hardware tag and the machine
    it was timed on (not this machine's 'cpu'); the acceptance pass's machine is recorded beside it."""
    out = tmp_path / "p.json"
    argv = ["tune", "--model", "tiny-ouro", "--cost-from", "tiny-ouro", "--prompts", "builtin", "--grid", "1,1"]
    assert main([*argv, "--batch-sizes", "1,2", "--num-prompts", "1", "--acceptance-tokens", "3", "--quiet",
                 "--out", str(out)]) == 0  # fmt: skip
    shipped = load_preset("tiny-ouro", 4)
    tuned = read_preset_file(out)
    assert tuned.hardware == shipped.hardware == "cpu-2core" and tuned.cost == shipped.cost
    assert tuned.provenance["cost_machine"] == shipped.provenance["machine"]
    assert tuned.provenance["machine"]["torch_threads"] == 1  # --threads defaults to 1, recorded
    assert tuned.provenance["cost_measured"] == shipped.provenance["cost_measured"]


def test_cli_tune_cost_from_a_shipped_preset_reports_its_checked_plans(tmp_path, capsys):
    """The shipped presets were timed before the tuner summed its check up (no `validation_summary`): reusing one,
    the report said no speculative plan was checked against plain, beside a table of such plans' checked rounds."""
    out = tmp_path / "p.json"
    argv = ["tune", "--model", "tiny-ouro", "--cost-from", "tiny-ouro", "--prompts", "builtin", "--grid", "1,1"]
    assert main([*argv, "--batch-sizes", "1", "--num-prompts", "1", "--acceptance-tokens", "3", "--quiet",
                 "--out", str(out)]) == 0  # fmt: skip
    printed = capsys.readouterr().out
    validation = load_preset("tiny-ouro", 4).provenance["cost"]["validation"]
    assert any(not key.startswith("0,") and cell["rounds"] >= 3 for key, cell in validation.items())
    assert "not checked" not in printed and "plans against plain: " in printed
    summary = read_preset_file(out).provenance["cost"]["validation_summary"]
    assert summary == validation_summary(validation) and summary["worst_cell"] in printed


def test_cli_tune_cost_from_errors_name_the_flag_and_keep_a_files_errors_apart(tmp_path, capsys):
    argv = ["tune", "--model", "tiny-ouro", "--out", str(tmp_path / "p.json"), "--cost-from"]
    assert main([*argv, "nosuch"]) == 2
    assert capsys.readouterr().err.startswith("looped-spec: error: --cost-from nosuch: no such preset file or shipped")
    assert main([*argv, str(tmp_path)]) == 2
    assert f"--cost-from {tmp_path}: a directory, not a preset file" in capsys.readouterr().err
    bad = tmp_path / "bad.json"
    bad.write_text('{"model": "x"}')
    assert main([*argv, str(bad)]) == 2
    assert capsys.readouterr().err == (f"looped-spec: error: --cost-from {bad}: full_depth: Field required; buckets: "
                                       "Field required; cost: Field required\n")  # fmt: skip
    # the engine's reading of the same file: one line, its errors apart
    assert main(["generate", "--model", "tiny-ouro", "--prompt", "x", "--preset", str(bad)]) == 2
    assert f"{bad}: full_depth: Field required; {bad}: buckets: Field required;" in capsys.readouterr().err


def test_tune_seed_draws_the_random_prompts():
    def random_prompt_run(seed):
        _, report = tune(load("ouro"), [1], "random", "1,1", acceptance_tokens=2, num_prompts=1, seed=seed,
                         cost_profile=PROFILE, progress=False)  # fmt: skip
        return report["prompts"], report["settings"]["seed"]

    (first, seed0), (second, seed5) = random_prompt_run(0), random_prompt_run(5)
    assert (seed0, seed5) == (0, 5) and "seed 5" in second["description"]
    assert first["fingerprints"] != second["fingerprints"]


def test_tune_refuses_early_exit_and_a_depth_of_one_naming_the_option():
    huginn = str(fixture_dir("huginn"))
    with pytest.raises(TunerError, match="adapter option exit_threshold=0.001: early exit cannot be tuned"):
        tune(huginn, [1], "builtin", "1,1", adapter_options={"exit_threshold": 1e-3}, cost_profile=PROFILE,
             progress=False)  # fmt: skip
    with pytest.raises(TunerError, match="adapter option num_steps=1: the model has full depth D=1; self-speculation"):
        tune(huginn, [1], "builtin", "1,1", adapter_options={"num_steps": 1}, cost_profile=PROFILE, progress=False)


def test_tune_bounds_batch_sizes_by_the_memory_their_timed_rounds_hold(monkeypatch):
    monkeypatch.setattr("looped_spec.tuning.tuner.available_memory", lambda device: (2**30, "free for the test"))
    with pytest.raises(TunerError, match=r"--batch-sizes 1,100000: .* GiB, more than the 1 GiB free for the test"):
        tune(load("ouro"), [1, 100000], "builtin", "1,1", progress=False)
    # a given cost profile times no rounds: its batch sizes only set the buckets, whatever memory is free
    tune(load("ouro"), [1, 4096], "builtin", "1,1", acceptance_tokens=2, num_prompts=1, cost_profile=PROFILE,
         progress=False)  # fmt: skip


def test_tune_length_error_names_the_flags_that_set_the_output_tokens():
    adapter = load("ouro")
    long_prompt = [[5] * (adapter.max_positions - 20)]
    with pytest.raises(TunerError, match=r"\(--acceptance-tokens 30\) exceed the model's 512 positions .*config"):
        tune(adapter, [1], long_prompt, "1,1", acceptance_tokens=30, cost_profile=PROFILE, progress=False)
    with pytest.raises(TunerError, match=r"\(--round-tokens 32 \+ the grid's largest K 2 \+ 2\)"):
        tune(adapter, [1], long_prompt, "2,1", acceptance_tokens=4, progress=False)


def test_cli_tune_prompt_groups_are_read_in_any_case_as_the_benchmarks_read_them(tmp_path, capsys):
    """`--prompts BUILTIN` was taken for a file named so (the benchmarks take any case); an unknown name is an error
    naming the flag and the groups."""
    out = tmp_path / "p.json"
    argv = ["tune", "--model", "tiny-ouro", "--cost-from", "tiny-ouro", "--grid", "1,1", "--batch-sizes", "1",
            "--num-prompts", "1", "--acceptance-tokens", "3", "--quiet", "--out", str(out)]  # fmt: skip
    assert main([*argv, "--prompts", "BUILTIN"]) == 0
    assert read_preset_file(out).provenance["prompts"]["source"] == "builtin"
    capsys.readouterr()
    assert main([*argv, "--prompts", "tunning"]) == 2
    assert "--prompts unknown prompt group 'tunning'" in capsys.readouterr().err


# ------------------------------------------------------------------ derivation rules, checked from the outside
def _tokens(a: float, k: int) -> float:
    """Expected committed tokens of a K-token draft whose positions agree independently with probability a."""
    return sum(a**i for i in range(k + 1))


def _rate(alpha, option, h: float) -> float:
    """Expected ΣA/ΣK of `option` at difficulty h (independent positions): RULES["thresholds"] by hand."""
    k, d = option
    a = min(max(1.0 - h * (1.0 - alpha[d - 1]), 0.0), 1.0)
    return (_tokens(a, k) - 1.0) / k


def test_predicted_speeds_price_each_depth_by_its_own_agreement_and_persistence():
    """Independent reference: a plan's predicted ratio to plain (the decisions in the report) is the tokens its rounds
    commit on a simulated chain of depth d's own match bits (α_d, ρ_d), replayed, over its round time (the mutation
    check, every depth priced with the next depth's persistence, left every test passing)."""
    import random

    from looped_spec.tuning.acceptance_pass import simulate_tokens

    alpha, rho = [0.6, 0.8, 1.0], [0.7, 0.0, 0.0]
    seconds = lambda k, d: 1.0 if k == 0 else 1.0 + 0.2 * k * d  # noqa: E731
    grid = [(k, d) for k in (1, 2, 4) for d in (1, 2)]
    _, notes = derive_bucket(BucketModel(alpha, rho, seconds), grid, 1)
    rng = random.Random(0)
    for k, d in grid:
        a, r = alpha[d - 1], rho[d - 1]
        bits, prev = [], rng.random() < a
        for _ in range(100_000):  # P(1 | 0) = a(1 - r), P(1 | 1) = r + a(1 - r)
            bits.append(int(prev))
            prev = rng.random() < (r + a * (1.0 - r) if prev else a * (1.0 - r))
        tokens, rounds = simulate_tokens([bits], k)
        assert notes["predicted_ratio"][f"{k},{d}"] == pytest.approx(tokens / rounds / seconds(k, d), rel=0.02), (k, d)


def test_thresholds_sit_where_neighbours_change_places():
    """Between neighbours the fastest plan changes at the decisions' switch_h; the lower one's theta_up is its expected
    acceptance there + margin, the upper one's theta_down its acceptance there - margin, a prior the acceptance at the
    measured text (h = 1), computed here by hand (the mutation checks — bisection towards the wrong end, margins of the
    wrong sign, the prior read at the switch — left every test passing)."""
    alpha = [0.7, 0.85, 0.95, 1.0]
    model = _linear_profile_model(alpha)
    grid = [(k, d) for k in range(1, 6) for d in range(1, 4)]
    data, notes = derive_bucket(model, grid, 1, near=0.0)
    cands = data["candidates"]
    options = [(c["k"], c["d"]) for c in cands]
    assert len(options) >= 3 and len(notes["switch_h"]) == len(options) - 1
    for i, h in enumerate(notes["switch_h"]):
        lower, upper = options[i], options[i + 1]
        assert model.speed(lower, h * 1.02) > model.speed(upper, h * 1.02), (lower, upper, h)
        assert model.speed(upper, h / 1.02) > model.speed(lower, h / 1.02), (lower, upper, h)
        if lower != (0, 0):
            assert cands[i]["theta_up"] == pytest.approx(_rate(alpha, lower, h) + 0.03, abs=2e-3)
        assert cands[i + 1]["theta_down"] == pytest.approx(max(_rate(alpha, upper, h) - 0.03, 0.0), abs=2e-3)
    assert cands[-1]["theta_up"] == 1.0
    for c in cands[1:]:
        assert c["prior"] == pytest.approx(_rate(alpha, (c["k"], c["d"]), 1.0), abs=1e-3)


def test_ema_knobs_follow_the_rule_from_the_initial_candidates_acceptance():
    """RULES["ema"] by hand: the noise of one round's acceptance at the initial candidate's K and the bucket's batch
    size sets beta, min_samples and interval; a bucket starting at plain takes them from its first speculative
    candidate (the mutation checks — the noise without K or at batch 1, beta x/(1+x), interval = min_samples, a plain
    start's knobs at an acceptance of 0.5 and K = 1 — left every test passing)."""
    import math

    def knobs(a, k, b):
        s = math.sqrt(max(a * (1.0 - a), 0.05) / (b * k))
        x = (0.05 / s) ** 2
        beta = min(max(2.0 * x / (1.0 + x), 0.1), 0.5)
        samples = max(4, math.ceil(1.0 / beta))
        return {"beta": round(beta, 3), "min_samples": samples, "interval": max(2, math.ceil(samples / 2))}

    alpha = [0.3, 0.9, 1.0]
    grid = [(1, 1), (2, 1), (4, 2)]
    for cost, batch in ((0.1, 2), (0.5, 8)):
        seconds = lambda k, d, c=cost: 1.0 if k == 0 else 1.0 + c * k * d  # noqa: E731
        data, _ = derive_bucket(BucketModel(alpha, [0.0] * 3, seconds), grid, batch)
        ref = data["candidates"][data["initial_index"] or 1]
        option = (ref["k"], ref["d"])
        want = knobs(_rate(alpha, option, 1.0), option[0], batch)
        assert 0.1 < want["beta"] < 0.5  # inside the clamp, so every term shows
        assert {key: data[key] for key in want} == want, (cost, data["initial_index"], option)
    assert data["initial_index"] == 0  # the second case starts at plain


def test_near_options_count_at_the_measured_text_and_its_variants_only():
    """RULES["order"]: options within 6 % of the fastest join where the measurements allow it, at a difficulty within
    a factor 1.5 of the measured text's or at an acceptance variant; an option near the fastest only on text far
    easier than measured does not. A variant whose fastest plan is on the path already adds nothing (the mutation
    checks — the band open towards easy text, the variants not counted, a variant's plan added twice — passed)."""
    sec = {(0, 0): 1.0, (1, 1): 1.3, (3, 1): 2.6}
    far = BucketModel([0.3, 1.0], [0.0, 0.0], lambda k, d: sec[(k, d)])
    a = 1.0 - 0.7 / 16  # depth 1's agreement on the easiest text of the sweep
    assert _tokens(a, 3) / 2.6 >= 0.94 * _tokens(a, 1) / 1.3  # (3, 1) near the fastest there ...
    data, _ = derive_bucket(far, [(1, 1), (3, 1)], 1)
    assert [(c["k"], c["d"]) for c in data["candidates"]] == [(0, 0), (1, 1)]  # ... and not a candidate

    sec = {(0, 0): 1.0, (1, 1): 1.3, (2, 1): 1.6, (1, 2): 1.6, (3, 2): 3.0}
    grid = [(1, 1), (2, 1), (1, 2), (3, 2)]
    alpha, variant = [0.3, 0.6, 1.0], [0.3, 0.9, 1.0]
    assert _tokens(0.9, 3) / 3.0 >= 0.94 * _tokens(0.9, 1) / 1.6  # (3, 2) near the variant's fastest, (1, 2)

    def options(variants):
        data, _ = derive_bucket(BucketModel(alpha, [0.0] * 3, lambda k, d: sec[(k, d)], variants), grid, 1)
        return [(c["k"], c["d"]) for c in data["candidates"]]

    assert (3, 2) not in options([]) and (3, 2) in options([(variant, [0.0] * 3)])
    measured = _linear_profile_model([0.8, 0.9, 0.97, 1.0])
    grid = [(k, d) for k in range(1, 6) for d in range(1, 4)]
    alone, _ = derive_bucket(measured, grid, 1)
    same = BucketModel(measured.alpha, measured.rho, measured.seconds, [(measured.alpha, measured.rho)] * 2)
    assert derive_bucket(same, grid, 1)[0] == alone  # the measured text's own fastest: on the path already


def test_a_bucket_where_nothing_pays_probes_the_option_closest_to_paying():
    """The probe target of a bucket where no option beats plain is the option fastest on the easiest text of the
    sweep (by hand: the deepest draft, K = 1), not any option (the mutation check, the slowest, passed)."""
    alpha = [0.5, 0.6, 0.7, 1.0]
    model = BucketModel(alpha, [0.0] * 4, lambda k, d: 1.01 * (k + 1) if k else 1.0)
    grid = [(k, d) for k in range(1, 4) for d in range(1, 4)]
    data, _ = derive_bucket(model, grid, 8)
    easy = {o: _tokens(1.0 - (1.0 - alpha[o[1] - 1]) / 16, o[0]) / (1.01 * (o[0] + 1)) for o in grid}
    assert max(easy, key=easy.get) == (1, 3)
    assert [(c["k"], c["d"]) for c in data["candidates"]] == [(0, 0), (1, 3)]


def test_each_bucket_is_priced_at_its_own_batch_size_and_speculation_goes_off_at_the_lowest_off_threshold():
    """On the idealised profile (a pass saturates at 16 positions) speculation pays at B = 1 and not at B = 64: the
    bucket of B = 64 starts at plain (the mutation check, every bucket priced at B = 1, passed). The disable threshold
    is the smallest of the buckets' off thresholds (their first speculative candidates' theta_down)."""
    cost = PassCost(CostConfig.model_validate(PROFILE), 4)
    alpha = [0.5, 0.6, 0.7, 1.0]
    models = {b: BucketModel(alpha, [0.0] * 4, pass_seconds(cost, b, 50.0)) for b in (1, 4, 64)}
    grid = [(k, d) for k in range(1, 6) for d in range(1, 4)]
    buckets, disable, _ = derive_buckets(models, grid)
    starts = [b["candidates"][b["initial_index"]]["k"] for b in buckets]
    assert starts[0] > 0 and starts[-1] == 0, starts
    offs = [b["candidates"][1]["theta_down"] for b in buckets]
    assert len(set(offs)) > 1 and disable["threshold"] == min(offs)
    assert all(len(b["candidates"]) > 2 for b in buckets)  # the first speculative candidate is not the last one


def test_derive_preset_keeps_the_knobs_and_disable_settings_given_and_drafts_at_every_depth():
    """scripts/derive_presets.py's settings reach the preset (the mutation checks, the bucket knobs or the disable
    settings given dropped, passed), and the grid reaches the deepest draft depth D - 1 (the check, a grid to D - 2,
    passed: that depth is a candidate here)."""
    knobs = {"beta": 0.2, "min_samples": 8, "interval": 4}
    data = derive_preset("m", 4, [0.7, 0.87, 0.94, 1.0], 64.0, bucket_knobs=knobs, disable={"probe_base": 32})
    config = AdaptiveSpecConfig.parse(data)
    assert all((b.beta, b.min_samples, b.interval) == (0.2, 8, 4) for b in config.buckets)
    assert config.disable.probe_base == 32
    assert any(c.d == 3 for b in config.buckets for c in b.candidates)


def test_derive_preset_prices_a_bucket_at_its_geometric_mean_batch_size():
    """A derived bucket of 4..64 requests is the bucket derived at 16 (the geometric mean), not at 4 (its lower
    bound), which differs; the unbounded one from 8 the bucket at 16 (twice its lower bound)."""
    alpha = [0.5, 0.75, 0.9, 1.0]

    def bucket(lo, hi):
        out = derive_preset("m", 4, alpha, 32.0, buckets=[(lo, hi)], max_k=2)["buckets"][0]
        return {key: value for key, value in out.items() if key not in ("min_batch", "max_batch")}

    assert bucket(4, 64) == bucket(16, 16) == bucket(8, None) != bucket(4, 4)


def _evenly(rate: float, n: int = 40) -> list[int]:
    """n match bits agreeing at `rate`, spread evenly."""
    return [int((i + 1) * rate) - int(i * rate) for i in range(n)]


#: Match bits [depth][prompt][position] of two prompts: depth 2 agrees far more often on the second
UNEVEN_BITS = [
    [_evenly(0.45), _evenly(0.5)],
    [_evenly(0.3), _evenly(0.9)],
    [_evenly(0.9), _evenly(0.95)],
    [_evenly(1.0), _evenly(1.0)],
]


def _tune_on_bits(monkeypatch, bits, prompts, grid, cost_profile, **options):
    """`tune` of the ouro fixture at batch size 1 with the acceptance pass's match bits given (`bits`)."""
    monkeypatch.setattr("looped_spec.tuning.tuner.measure_match_bits", lambda adapter, prompts, *a: bits)
    grid = ";".join(f"{k},{d}" for k, d in grid)
    config, _ = tune(load("ouro"), [1], prompts, grid, acceptance_tokens=4, num_prompts=len(prompts),
                     cost_profile=cost_profile, progress=False, **options)  # fmt: skip
    return config.buckets[0]


def test_tune_adds_the_fastest_plan_of_each_tuning_prompt_alone(monkeypatch):
    """At batch size 1 a batch is one tuning prompt: each prompt's own fastest plan (at its own acceptance) is a
    candidate, though the sweep of the prompts' mean acceptance never makes it the fastest."""
    from looped_spec.tuning.acceptance_pass import bit_statistics

    grid = [(k, d) for k in (1, 2, 3, 5) for d in (1, 2, 3)]
    cost = ideal_cost(8.0)
    bucket = _tune_on_bits(monkeypatch, UNEVEN_BITS, [[5] * 50] * 2, grid, cost)
    candidates = [(c.k, c.d) for c in bucket.candidates]
    seconds = pass_seconds(PassCost(CostConfig.model_validate(cost), 4), 1, 50.0)
    for prompt in range(2):
        stats = [bit_statistics([depth_bits[prompt]]) for depth_bits in UNEVEN_BITS]
        alone = BucketModel([s[0] for s in stats], [s[1] for s in stats], seconds)
        assert alone.fastest([(0, 0), *grid], 1.0) in candidates, prompt


def test_tune_prices_plans_at_the_profiles_mean_context_else_the_longest_prompt(monkeypatch):
    """Given a profile whose passes cost more at longer contexts, the preset is priced at its report's mean context
    (the timed rounds'), and without a report at the longest prompt's."""
    grid = [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3)]
    prompts = [[5] * 40, [5] * 30]

    def bucket(report):
        out = _tune_on_bits(monkeypatch, UNEVEN_BITS, prompts, grid, KNOWN_PROFILE, cost_report=report)
        return out.model_dump()

    assert bucket(None) == bucket({"mean_context": 40.0}) != bucket({"mean_context": 3000.0})


def test_tune_passes_its_margin_to_the_thresholds(monkeypatch):
    """A wider margin moves every threshold that is not clamped by as much: theta_up up, theta_down down."""
    grid = [(1, 1), (2, 1), (3, 1), (1, 2), (2, 2), (1, 3)]
    narrow, wide = (
        _tune_on_bits(monkeypatch, UNEVEN_BITS, [[5] * 40] * 2, grid, KNOWN_PROFILE, margin=m).candidates
        for m in (0.03, 0.13)
    )
    assert [(c.k, c.d) for c in narrow] == [(c.k, c.d) for c in wide]
    moved = 0
    for a, b in zip(narrow[1:-1], wide[1:-1]):
        if a.theta_up + 0.1 < 1.0:
            assert b.theta_up == pytest.approx(a.theta_up + 0.1, abs=1.5e-3)
            moved += 1
        if 0.1 < a.theta_down < a.theta_up:
            assert b.theta_down == pytest.approx(a.theta_down - 0.1, abs=1.5e-3)
            moved += 1
    assert moved >= 2
