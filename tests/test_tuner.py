"""Offline tuner: CLI end to end on the fixtures, the written preset, bucket/order/threshold rules, inputs."""

from __future__ import annotations

import json
import sys

import pytest
from conftest import fixture_dir, load

from looped_spec.cli import main
from looped_spec.control.goodput import expected_accept_rate
from looped_spec.control.presets import AdaptiveSpecConfig, load_preset, read_preset_file
from looped_spec.tuner import Progress, tune
from looped_spec.tuner_inputs import (
    TunerError,
    auto_grid,
    load_prompts,
    parse_adapter_options,
    parse_batch_sizes,
    parse_grid,
)
from looped_spec.tuner_report import dump_json
from looped_spec.tuner_rules import CellModel, break_even, bucket_ranges, build_bucket, invert_accept_rate

GRID = "1,1;2,1;1,2"
TINY = ["--batch-sizes", "1,4", "--screen-tokens", "4", "--confirm-tokens", "6", "--top", "2", "--quiet"]


def test_cli_tune_writes_a_valid_preset_and_heatmap(tmp_path, capsys):
    out, png = tmp_path / "presets" / "ouro-tiny.json", tmp_path / "heat.png"
    rc = main(
        [
            "tune",
            "--model",
            str(fixture_dir("ouro")),
            "--grid",
            GRID,
            "--out",
            str(out),
            "--heatmap",
            str(png),
            "--hardware",
            "test-cpu",
            *TINY,
        ]
    )
    assert rc == 0
    printed = capsys.readouterr().out
    assert "B=1:" in printed and "B=4:" in printed and "preset buckets" in printed
    config = read_preset_file(out)
    loaded = load_preset("ouro-tiny", 4, preset=out)
    assert loaded.hardware == "test-cpu" and loaded.full_depth == 4
    buckets = config.buckets
    assert buckets[0].min_batch == 1 and buckets[-1].max_batch is None
    for prev, nxt in zip(buckets, buckets[1:]):
        assert nxt.min_batch == prev.max_batch + 1
    assert [(b.min_batch, b.max_batch) for b in buckets] == [(1, 2), (3, None)]
    allowed = {(0, 0), (1, 1), (2, 1), (1, 2)}
    for b in buckets:
        cands = [(c.k, c.d) for c in b.candidates]
        assert cands[0] == (0, 0) and set(cands) <= allowed and 2 <= len(cands) <= 3  # K=0 + at most top 2
        assert 0 <= b.initial_index < len(cands)
        for c in b.candidates[1:]:
            assert 0.0 <= c.theta_down <= c.theta_up <= 1.0
    assert config.disable.enabled
    prov = config.provenance
    assert isinstance(prov, dict)
    assert prov["command"].startswith("looped-spec tune --model") and prov["model"]["full_depth"] == 4
    assert {"platform", "cpu_count", "torch", "device"} <= set(prov["machine"])
    assert prov["settings"]["grid"] == ["1,1", "2,1", "1,2"] and set(prov["rules"]) >= {"buckets", "thresholds"}
    for b in ("1", "4"):
        cells = prov["measurements"][b]["screen"]["cells"]
        assert set(cells) == {"1,1", "2,1", "1,2"}
        for cell in cells.values():
            assert cell["ratio"] > 0 and 0.0 <= cell["acceptance"] <= 1.0 and cell["tokens_per_round"] >= 1.0
        assert len(prov["measurements"][b]["confirm"]["cells"]) == 2
    assert png.is_file() and png.stat().st_size > 1000


def test_cli_tune_rejects_a_grid_entry_beyond_the_depth(tmp_path, capsys):
    out = tmp_path / "nb.json"
    rc = main(["tune", "--model", str(fixture_dir("nanbeige")), "--grid", GRID, "--out", str(out), *TINY])
    assert rc == 2
    err = capsys.readouterr().err
    assert "'1,2'" in err and "d=2" in err and "D=2" in err
    assert not out.exists()


def test_tune_api_on_nanbeige_depth_two():
    config, report = tune(load("nanbeige"), [1, 2], "builtin", "1,1;2,1", 3, 4, 1, repeats=1, progress=False)
    assert isinstance(config, AdaptiveSpecConfig)
    assert [(b.min_batch, b.max_batch) for b in config.buckets] == [(1, 1), (2, None)]
    for b in config.buckets:
        assert [c.k for c in b.candidates][0] == 0 and all(c.d <= 1 for c in b.candidates)
    assert set(report["measurements"]) == {"1", "2"} and config.provenance == report
    config.validate_for_depth(2)


def test_bucket_ranges_nearest_in_log_space():
    assert bucket_ranges([1, 8, 32]) == [(1, 2), (3, 16), (17, None)]
    assert bucket_ranges([4]) == [(1, None)]
    assert bucket_ranges([2, 1]) == [(1, 1), (2, None)]
    assert bucket_ranges([1, 4, 64]) == [(1, 2), (3, 16), (17, None)]


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
    text = tmp_path / "p.txt"
    text.write_text("def f(x):\n\n  hello world \n")
    assert load_prompts(str(text), adapter, 3)[0] == ["def f(x):", "  hello world ", "def f(x):"]
    jsonl = tmp_path / "p.jsonl"
    jsonl.write_text(json.dumps({"prompt": "a\nb"}) + "\n" + json.dumps({"prompt": [5, 6]}) + "\n")
    assert load_prompts(str(jsonl), adapter, 2)[0] == ["a\nb", [5, 6]]
    jsonl.write_text('{"text": 1}\n')
    with pytest.raises(TunerError, match="p.jsonl:1"):
        load_prompts(str(jsonl), adapter, 2)


def test_thresholds_bracket_the_measured_acceptance_of_the_best_candidate():
    """A trained-model-like bucket: the measured best becomes initial and its band contains its acceptance."""
    confirmed = {
        "1,3": {"ratio": 1.10, "acceptance": 0.90},
        "2,1": {"ratio": 1.35, "acceptance": 0.62},
        "4,1": {"ratio": 1.20, "acceptance": 0.55},
    }
    bucket, notes = build_bucket(1, 1, 1, confirmed, margin=0.03, min_gain=0.02)
    cands = [(c["k"], c["d"]) for c in bucket["candidates"]]
    assert cands[0] == (0, 0) and set(cands[1:]) == {(1, 3), (2, 1), (4, 1)}
    best = bucket["candidates"][bucket["initial_index"]]
    assert (best["k"], best["d"]) == (2, 1)
    assert best["theta_down"] < 0.62 < best["theta_up"]
    assert cands.index((4, 1)) > cands.index((2, 1))  # more drafts at the same depth: more aggressive
    AdaptiveSpecConfig.parse({"model": "m", "buckets": [{**bucket, "max_batch": None}]}).validate_for_depth(4)
    assert notes["initial"] == "2,1" and notes["chain"] == ["0,0", "1,3", "2,1", "4,1"]
    for j, c in enumerate(bucket["candidates"][1:], start=1):  # at the measured acceptance, all roads lead to 2,1
        if j < bucket["initial_index"]:
            assert c["prior"] > c["theta_up"]
        elif j > bucket["initial_index"]:
            assert c["prior"] < c["theta_down"]
    slow = {k: {**v, "ratio": v["ratio"] / 2} for k, v in confirmed.items()}
    assert build_bucket(1, None, 8, slow, margin=0.03, min_gain=0.02)[0]["initial_index"] == 0


def test_model_helpers():
    for k in (1, 3):
        for a in (0.0, 0.3, 0.8):
            assert invert_accept_rate(expected_accept_rate(a, k), k) == pytest.approx(a, abs=1e-6)
    cell = CellModel(2, 1, ratio=1.3, acceptance=0.6)
    assert cell.speedup(1.0) == pytest.approx(1.3)
    assert 1.0 < break_even(cell) < 16.0  # faster than plain, so it still breaks even on a harder workload
    assert break_even(CellModel(1, 1, ratio=0.5, acceptance=0.0)) < 1.0


def test_dump_json_and_progress_fallback(monkeypatch, capsys):
    data = {"a": [1, 2], "b": {"c": list(range(60))}}
    assert json.loads(dump_json(data)) == data
    monkeypatch.setitem(sys.modules, "tqdm", None)
    bar = Progress(2)
    bar.step("one")
    bar.step("two")
    bar.close()
    assert "[2/2] two" in capsys.readouterr().err


def test_cli_tune_reports_a_greedy_mismatch_as_a_bug(tmp_path, capsys, monkeypatch):
    import looped_spec.tuner as tuner

    real_run = tuner.EngineSet.run

    def corrupted(self, cell, prompts, max_tokens):
        result = real_run(self, cell, prompts, max_tokens)
        if cell == (2, 1):
            result.outputs[-1][-1] += 1
        return result

    monkeypatch.setattr(tuner.EngineSet, "run", corrupted)
    out = tmp_path / "x.json"
    rc = main(["tune", "--model", str(fixture_dir("ouro")), "--grid", GRID, "--out", str(out), *TINY])
    err = capsys.readouterr().err
    assert rc == 1 and "BUG" in err and "K=2 d=1" in err and "prompt 0" in err
    assert not out.exists()


def test_random_measurements_always_give_valid_buckets_starting_at_the_best():
    import random

    rng = random.Random(1)
    for _ in range(60):
        confirmed = {}
        for _ in range(rng.randint(1, 4)):
            confirmed[f"{rng.randint(1, 5)},{rng.randint(1, 3)}"] = {
                "ratio": rng.uniform(0.3, 3.0),
                "acceptance": rng.choice([0.0, 1.0, rng.random()]),
            }
        bucket, _ = build_bucket(1, None, rng.choice([1, 8, 32]), confirmed, margin=0.03, min_gain=0.02)
        AdaptiveSpecConfig.parse({"model": "m", "buckets": [bucket]}).validate_for_depth(4)
        best = max(confirmed, key=lambda key: confirmed[key]["ratio"])
        chosen = bucket["candidates"][bucket["initial_index"]]
        if confirmed[best]["ratio"] >= 1.02:
            assert f"{chosen['k']},{chosen['d']}" == best
        else:
            assert chosen["k"] == 0
