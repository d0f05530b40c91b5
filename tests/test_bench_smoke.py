"""Smoke tests of benchmarks/bench_speculative.py and bench_early_exit.py (on the random-weight fixture) and
bench_controller.py (no timed assertions)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from looped_spec import LoopedSpecEngine, load_adapter
from looped_spec.control import FixedController
from looped_spec.tuning.grid import Phase
from looped_spec.tuning.prompt_sets import prompt_fingerprints, prompt_group, random_prompts

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = str(ROOT / "tests" / "fixtures" / "ouro-tiny")
SMALL = ["--model", FIXTURE, "--prompts", "random", "--batch-sizes", "1,2", "--grid", "1,1", "--max-tokens", "4"]
SMALL += ["--repeats", "2", "--threads", "1"]


def load_script(name: str):
    """benchmarks/<name>.py as a module."""
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault(name, module)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    return load_script("bench_speculative")


def test_bench_runs_side_by_side_with_an_aa_line(bench, tmp_path, capsys):
    out = tmp_path / "smoke"
    report = bench.main([*SMALL, "--out", str(out)])
    printed = capsys.readouterr().out
    assert printed.startswith("$ ") and "A/A (plain-B vs plain):" in printed
    data = json.loads((tmp_path / "smoke.json").read_text())
    assert data["command"] == report["command"] and "--grid" in data["command"]
    assert set(data["configs"]) == {"plain", "plain-B", "1,1", "adaptive"}
    assert data["configs"]["adaptive"]["kind"] == "adaptive"
    for b in ("1", "2"):
        row = data["batch_sizes"][b]
        for stat in [row["aa"], row["configs"]["1,1"]["ratio"], row["configs"]["adaptive"]["ratio"]]:
            assert stat["min"] <= stat["median"] <= stat["max"]
            assert len(stat["per_round"]) == 1  # repeats 2, the first round discarded
        assert row["aa"] == row["configs"]["plain-B"]["ratio"]
        assert len(row["rounds"]) == 2 and len(row["orders"]) == 2
        assert row["summary"]["best_fixed"] == "1,1"
        assert "vs_best_fixed" in row["summary"]["adaptive"]["adaptive"]
        # every non-plain config (plain-B, 1,1, adaptive) checked against plain in each of the 2 rounds
        assert row["equality_checks"] == 3 * 2
        assert all(run["decode_tokens"] == int(b) * 3 for run in row["rounds"][1].values())
    assert data["equality_checks"] == 12
    assert data["workload"] is None
    # rounds rotate through a pool of prompts, every one of them checked against the preset's tuning prompts
    assert data["prompts"]["fingerprints"] == prompt_fingerprints(random_prompts(bench.ROTATION_POOL, 256, 0))


def test_rounds_rotate_through_the_prompts_unless_asked_for_the_same_ones(bench, tmp_path, capsys):
    pool = bench.PromptPool(list(range(10)), rotate=True)
    seen = []
    for _ in range(3):
        seen.append((pool.slice(0, 2), pool.slice(2, 3)))  # a round's phases: consecutive slices
        pool.next_round()
    stride = bench.ROTATION_STRIDE
    assert seen[0] == ([0, 1], [2, 3, 4])
    assert seen[1] == ([stride % 10, (stride + 1) % 10], [(stride + 2 + i) % 10 for i in range(3)])  # wraps
    assert seen[2][0] == [(2 * stride) % 10, (2 * stride + 1) % 10]
    same = bench.PromptPool(list(range(10)), rotate=False)
    same.next_round()
    assert same.slice(0, 2) == [0, 1]
    bench.main([*SMALL, "--same-prompts", "--out", str(tmp_path / "same.json")])  # a .json OUT is the file itself
    assert not (tmp_path / "same.json.json").exists()
    data = json.loads((tmp_path / "same.json").read_text())
    assert data["prompts"]["fingerprints"] == prompt_fingerprints(random_prompts(2, 256, 0))
    # --repeats 2 measures one round: no held-out choice to compute, and the run says so (not "nanx ±nan")
    printed = capsys.readouterr().out
    assert "nan" not in printed and "held-out choice n/a: one measured round" in printed


def test_bench_confirmation_reruns_the_screens_top_cells(bench, tmp_path, capsys):
    grid = ["--grid", "1,1;2,1;1,2", "--batch-sizes", "2", "--confirm-repeats", "3", "--confirm-top", "2"]
    report = bench.main([*SMALL, *grid, "--out", str(tmp_path / "c")])
    row = report["batch_sizes"]["2"]
    screen = {n: row["configs"][n]["ratio"]["median"] for n in ("1,1", "2,1", "1,2")}
    c = row["confirm"]
    top = c["configs"][2:4]
    assert c["configs"][:2] == ["plain", "plain-B"] and c["configs"][4:] == ["adaptive"]
    assert sorted(screen, key=lambda n: -screen[n])[:2] == top and c["best_fixed"] == top[0]
    assert len(c["rounds"]) == 3 and all(set(rd) == set(c["configs"]) for rd in c["rounds"])
    assert c["equality_checks"] == 4 * 3  # plain-B, two cells and adaptive against plain, 3 rounds
    assert report["equality_checks"] == row["equality_checks"] + 12
    entry = c["adaptive"]["adaptive"]
    first = c["rounds"][0]
    assert entry["vs_best_fixed"]["per_round"][0] == first["adaptive"]["tokens_per_s"] / first[top[0]]["tokens_per_s"]
    assert len(entry["vs_best_fixed_held_out"]["per_round"]) == 3
    assert c["aa"]["per_round"][0] == first["plain-B"]["tokens_per_s"] / first["plain"]["tokens_per_s"]
    printed = capsys.readouterr().out
    assert "confirmation (3 more rounds" in printed and "confirmed (3 rounds)" in printed
    tables = load_script("results_table")
    assert "Confirmation rounds" in tables.table(json.loads((tmp_path / "c.json").read_text()))


@pytest.mark.parametrize("bad", [["--confirm-repeats", "1"], ["--confirm-repeats", "-2"], ["--confirm-top", "0"]])
def test_bench_confirmation_options_are_checked(bench, bad, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, *bad])
    assert exc.value.code == 2 and "--confirm-" in capsys.readouterr().err


def test_bench_ab_of_a_tunable_reports_the_ratio_to_the_defaults(bench, capsys):
    argv = [*SMALL, "--batch-sizes", "2", "--policies", "default,default:readout_positions=8", "--confirm-repeats", "2"]
    report = bench.main(argv)
    row = report["batch_sizes"]["2"]
    assert "adaptive[readout_positions=8]" in report["configs"]
    for entries in (row["summary"]["adaptive"], row["confirm"]["adaptive"]):
        assert "vs_base" not in entries["adaptive"]
        assert entries["adaptive[readout_positions=8]"]["vs_base"]["base"] == "adaptive"
    assert "vs adaptive " in capsys.readouterr().out


@pytest.mark.parametrize(
    "policies, message",
    [
        ("default:readout_positions", "FIELD=VALUE"),
        ("default:no_such_field=1", "'no_such_field=1' is not FIELD=VALUE"),
        ("default:readout_budget=0.1:hysteresis=0", "readout_budget='0.1:hysteresis=0' is not a JSON value"),
    ],
)
def test_bench_policy_switches_are_checked(bench, policies, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, "--policies", policies])
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_bench_workload_reports_the_oracle(bench):
    report = bench.main([*SMALL, "--batch-sizes", "1", "--workload", "--workload-phases", "1,2,1", "--max-tokens", "3"])
    wl = report["workload"]
    assert wl["phases"] == [1, 2, 1] and len(wl["oracle_phases"]) == 3
    assert set(wl["oracle_phases"]) <= {"plain", "1,1"}
    entry = wl["adaptive"]["adaptive"]
    assert {"vs_oracle", "vs_oracle_held_out", "vs_best_single_fixed", "vs_plain"} <= set(entry)
    assert wl["equality_checks"] == 3 * 3 * 2  # 3 non-plain configs x 3 phases x 2 rounds


def test_bench_workload_confirmation_runs_the_screens_oracle(bench):
    argv = [*SMALL, "--batch-sizes", "1", "--grid", "1,1;1,2", "--workload", "--workload-phases", "1,2,1"]
    report = bench.main([*argv, "--max-tokens", "3", "--confirm-repeats", "2"])
    wl = report["workload"]
    c = wl["confirm"]
    assert c["oracle_phases"] == wl["oracle_phases"] and c["best_single_fixed"] == wl["best_single_fixed"]
    assert c["configs"] == ["plain", "plain-B", wl["best_single_fixed"], "oracle", "adaptive"]
    assert len(c["rounds"]) == 2 and c["equality_checks"] == 4 * 3 * 2  # 4 configs x 3 phases x 2 rounds
    first = c["rounds"][0]

    def total(name):
        return sum(run["decode_s"] for run in first[name])

    # the oracle's phases ran on the engines the screen chose: each phase's plans are its engine's (a fixed cell
    # drafts at its d, fewer than K tokens near the budget's end, none with one token left)
    for run, chosen in zip(first["oracle"], wl["oracle_phases"]):
        drafted = {key for key in run["plans"] if key != "0,0"}
        if chosen == "plain":
            assert not drafted
        else:
            assert drafted and all(key.split(",")[1] == chosen.split(",")[1] for key in drafted)
    entry = c["adaptive"]["adaptive"]
    assert entry["vs_oracle"]["per_round"][0] == total("oracle") / total("adaptive")
    assert entry["vs_plain"]["per_round"][0] == total("plain") / total("adaptive")


def _logged_steps(engines: dict, log: list) -> None:
    """Record which engine steps, in order (wraps each engine's `step`)."""
    for name, engine in engines.items():
        step = engine.step

        def logged(step=step, name=name):
            log.append(name)
            return step()

        engine.step = logged


def test_sliced_runs_take_turns_and_decode_what_whole_generates_decode(bench):
    import random

    from looped_spec import SpeculativeConfig

    prompts = random_prompts(3, 256, 5)
    engines = {
        "plain": LoopedSpecEngine(FIXTURE, speculation="off", device="cpu", dtype="float32"),
        "spec": LoopedSpecEngine(FIXTURE, speculation=SpeculativeConfig(k=2, d=1), device="cpu", dtype="float32"),
    }
    want = {name: bench.timed_generate(engine, prompts, 6) for name, engine in engines.items()}
    log: list = []
    _logged_steps(engines, log)
    got = bench.timed_slices(engines, prompts, 6, 1e-9, random.Random(0))  # a turn is a single step
    for name in engines:
        record, outputs = got[name]
        assert outputs == want[name][1]
        assert record["decode_tokens"] == want[name][0]["decode_tokens"] == 3 * 5
        assert record["rounds"] == want[name][0]["rounds"] and record["decode_s"] > 0.0
    # one step of each engine per turn while both run: the engines alternate until the shorter one is done
    both = log[: 2 * log.count("spec")]
    assert all(sorted(both[i : i + 2]) == ["plain", "spec"] for i in range(0, len(both), 2))
    log.clear()
    bench.timed_slices(engines, prompts, 6, 60.0, random.Random(0))  # a turn long enough for a whole run
    first = log[0]
    assert log == [first] * log.count(first) + [n for n in log if n != first]


def test_a_phase_runs_each_engine_once_for_the_names_sharing_it(bench):
    import argparse
    import random

    engine = LoopedSpecEngine(FIXTURE, speculation="off", device="cpu", dtype="float32")
    other = LoopedSpecEngine(FIXTURE, speculation="off", device="cpu", dtype="float32")
    for slice_ms in (0.0, 20.0):
        args = argparse.Namespace(slice_ms=slice_ms, max_tokens=4)
        rounds = engine.stats.num_rounds
        done = bench.timed_phase(
            {"plain": engine, "oracle": engine, "plain-B": other}, [[5, 6, 7]], args, random.Random(1)
        )
        assert done["oracle"] is done["plain"] and done["plain-B"] is not done["plain"]
        assert engine.stats.num_rounds - rounds == done["plain"][0]["rounds"] == 3  # one run, not two


@pytest.mark.parametrize("slice_ms", ["-1", "nan"])
def test_bench_slice_option_is_checked(bench, slice_ms, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, "--slice-ms", slice_ms])
    assert exc.value.code == 2 and "--slice-ms" in capsys.readouterr().err


def test_bench_whole_generate_interleave_still_runs(bench, capsys):
    report = bench.main([*SMALL, "--batch-sizes", "2", "--slice-ms", "0"])
    assert report["args"]["slice_ms"] == 0.0 and report["equality_checks"] == 3 * 2
    assert "one after another" in capsys.readouterr().out


def test_interleave_check_reports_every_mode_and_cell(capsys):
    script = load_script("bench_interleave")
    argv = ["--model", FIXTURE, "--prompts", "random", "--grid", "1,1", "--max-tokens", "3", "--rounds", "3"]
    results = script.main(argv)
    assert set(results) == {"generate", "slice", "step"}
    for cells in results.values():
        assert set(cells) == {"plain-B", "1,1"}
        assert all(ratio > 0.0 and sd >= 0.0 and se >= 0.0 for ratio, sd, se in cells.values())
    assert "slice" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script.main([*argv, "--modes", "steps"])


def test_median_confidence_interval_is_the_order_statistics_around_the_median(bench):
    values = [float(v) for v in range(20, 0, -1)]  # 1..20, unsorted
    assert bench.median_ci(values) == (5.0, 16.0)  # j = floor((20 - 1.96 sqrt 20) / 2), k = ceil(1 + (20 + ..) / 2)
    assert bench.median_ci([3.0, 1.0, 2.0]) == (1.0, 3.0)  # too few values: their whole range
    stat = bench.spread([1.0, float("nan"), 2.0, 3.0])
    assert stat["ci"] == [1.0, 3.0] and stat["median"] == 2.0 and len(stat["per_round"]) == 4
    assert bench.fmt(stat) == "2.00x ±1.00 [1.00-3.00]"


def test_held_out_choice_scores_each_round_with_a_choice_made_on_the_others(bench):
    # two cells, three rounds: "b" wins on average, but only thanks to round 0's noise
    rounds = [{"a": 1.0, "b": 3.0}, {"a": 1.2, "b": 1.0}, {"a": 1.1, "b": 0.9}]

    def choose(others):
        return max(("a", "b"), key=lambda n: sum(r[n] for r in others))

    # chosen on all rounds, "b" would score [3.0, 1.0, 0.9]: round 0 both picks it and rewards it
    assert bench.held_out(rounds, choose, lambda rd, n: rd[n]) == [1.0, 1.0, 0.9]
    assert bench.held_out(rounds[:1], choose, lambda rd, n: rd[n]) != [1.0]  # nan: no other round to choose on


def write_preset(path: Path, provenance: dict, model: str = FIXTURE) -> Path:
    """The model's (default: the fixture's) own adaptive preset with the given provenance."""
    engine = LoopedSpecEngine(model, speculation="adaptive", device="cpu", dtype="float32")
    data = engine.controller.config.model_dump(mode="json")
    data["provenance"] = provenance
    path.write_text(json.dumps(data))
    return path


def test_bench_prints_the_tuners_prediction_beside_the_measurement(bench, tmp_path):
    provenance = {
        "prompts": {"fingerprints": prompt_fingerprints(random_prompts(4, 256, 99))},  # disjoint: checked, passes
        "decisions": {"1..1": {"predicted_ratio": {"1,1": 1.25}}, "2..inf": {"predicted_ratio": {"1,1": 0.5}}},
    }
    preset = write_preset(tmp_path / "ouro-tiny.json", provenance)
    report = bench.main([*SMALL, "--preset", str(preset)])
    assert report["overlap_check"]["checked"] == ["adaptive"]
    assert report["batch_sizes"]["1"]["configs"]["1,1"]["predicted_ratio"] == 1.25
    assert report["batch_sizes"]["2"]["configs"]["1,1"]["predicted_ratio"] == 0.5
    assert report["batch_sizes"]["2"]["predicted_bucket"] == "2..inf"


def test_bench_leaves_out_predictions_made_at_another_depth(bench, tmp_path, capsys):
    """A preset measured at D=8 serving the D=4 fixture: its "K,d" predictions are cells at D=8 ("1,1" there is not
    "1,1" here), so no pred column, and one line says why."""
    engine = LoopedSpecEngine(FIXTURE, speculation="adaptive", device="cpu", dtype="float32")
    deeper, _ = engine.controller.config.for_depth(8)
    data = deeper.model_dump(mode="json")
    data["provenance"] = {"decisions": {"1..inf": {"predicted_ratio": {"1,1": 1.25}}}}
    preset = tmp_path / "ouro-tiny-d8.json"
    preset.write_text(json.dumps(data))
    report = bench.main([*SMALL, "--batch-sizes", "1", "--preset", str(preset)])
    printed = capsys.readouterr().out
    assert report["preset_predictions"] is None
    assert "predicted_ratio" not in report["batch_sizes"]["1"]["configs"]["1,1"]
    assert "no pred column: the preset's predictions are for its cells at depth 8, the model runs D=4" in printed
    header = next(line for line in printed.splitlines() if line.split()[:1] == ["config"])
    assert "pred" not in header.split()  # no column of dashes


def test_bench_refuses_prompts_the_preset_was_tuned_on(bench, tmp_path, capsys):
    tuned = random_prompts(2, 256, 0)[1:]  # one of the two prompts the benchmark will use
    preset = write_preset(tmp_path / "ouro-tiny.json", {"prompts": {"fingerprints": prompt_fingerprints(tuned)}})
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, "--preset", str(preset)])
    assert exc.value.code == 2
    assert f"1 of the {bench.ROTATION_POOL} distinct evaluation prompts" in capsys.readouterr().err


#: a shipped model with a tokenizer (text prompt groups), the fastest of the three
TEXT = ["--model", "tiny-nanbeige", "--batch-sizes", "1", "--grid", "1,1", "--max-tokens", "3", "--repeats", "2"]
TEXT += ["--threads", "1"]


def test_workload_phases_switch_prompt_groups_and_report_each_phases_group(bench, monkeypatch):
    seen: list[list] = []
    timed_phase = bench.timed_phase

    def recording(jobs, prompts, args, rng):
        seen.append(list(prompts))
        return timed_phase(jobs, prompts, args, rng)

    monkeypatch.setattr(bench, "timed_phase", recording)
    report = bench.main([*TEXT, "--workload", "--workload-phases", "1:code,2:prose,1"])
    wl = report["workload"]
    assert wl["phases"] == [1, 2, 1] and report["args"]["phases"] == [1, 2, 1]  # the old fields, unchanged
    assert wl["phase_groups"] == wl["phase_prompts"] == ["code", "prose", "eval"]  # no group: --prompts (eval)
    groups = report["prompts"]["groups"]
    assert set(groups) == {"eval", "code", "prose"}
    for name in ("code", "prose"):  # rotation: a pool is the whole group, and every one of its prompts was checked
        assert groups[name]["fingerprints"] == prompt_fingerprints(prompt_group(name))
    assert report["prompts"]["fingerprints"] == groups["eval"]["fingerprints"]
    assert report["overlap_check"]["checked"] == ["adaptive"]
    workload_calls = seen[-3 * 2 :]  # 2 rounds x 3 phases, after the batch-size rounds
    for call, group in zip(workload_calls, ["code", "prose", "eval"] * 2):
        assert set(call) <= set(prompt_group(group)), group
    assert [len(call) for call in workload_calls] == [1, 2, 1, 1, 2, 1]
    assert wl["equality_checks"] == 3 * 3 * 2


def test_phases_of_one_pool_read_consecutive_slices(bench):
    phases = [Phase(1, "eval"), Phase(2, "code"), Phase(3, "eval")]
    assert bench.phase_slices(phases, lambda g: g) == [("eval", 0, 1), ("code", 0, 2), ("eval", 1, 3)]
    # a model without a tokenizer decodes random token ids for every group: one pool, as before groups
    assert bench.phase_slices(phases, lambda g: "random") == [("random", 0, 1), ("random", 1, 2), ("random", 3, 3)]


def test_workload_groups_without_a_tokenizer_become_random_ids(bench, capsys):
    report = bench.main(
        [*SMALL, "--batch-sizes", "1", "--workload", "--workload-phases", "1:code,2", "--max-tokens", "3"]
    )
    wl = report["workload"]
    assert wl["phase_groups"] == ["code", "random"] and wl["phase_prompts"] == ["random", "random"]
    assert set(report["prompts"]["groups"]) == {"random"}
    assert "group(s) code replaced by random token-id prompts" in capsys.readouterr().out


def test_bench_refuses_a_preset_tuned_on_a_workload_phases_prompts(bench, tmp_path, capsys):
    tuned = prompt_group("code")[5:6]  # not in --prompts eval: only the code phase decodes it
    provenance = {"prompts": {"fingerprints": prompt_fingerprints(tuned)}}
    preset = write_preset(tmp_path / "tiny-nanbeige.json", provenance, model="tiny-nanbeige")
    argv = [*TEXT, "--preset", str(preset), "--workload"]
    with pytest.raises(SystemExit) as exc:
        bench.main([*argv, "--workload-phases", "1,1:code"])
    assert exc.value.code == 2
    distinct = len(set(prompt_group("eval") + prompt_group("code")))
    assert f"1 of the {distinct} distinct evaluation prompts" in capsys.readouterr().err


def test_the_bench_evaluates_on_a_prompt_file_of_ones_own(bench, tmp_path, capsys):
    """--prompts and a workload phase take a .jsonl / .txt file: the run decodes its prompts, rotating through all of
    them, checks every one against the preset's tuning prompts, and refuses a preset tuned on one of them."""
    mine = [f"def handler_{i}(request):\n    return request.json()['x{i}']" for i in range(5)]
    jsonl = tmp_path / "mine.jsonl"
    jsonl.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in mine))
    text = tmp_path / "prose.txt"
    text.write_text("The server answers every request in turn.\nEach reply names its request.\n")
    report = bench.main([*TEXT, "--prompts", str(jsonl), "--workload", "--workload-phases", f"1,2:{text}"])
    assert report["prompts"]["fingerprints"] == prompt_fingerprints(mine)
    assert report["workload"]["phase_prompts"] == [str(jsonl), str(text)]
    groups = report["prompts"]["groups"]
    assert groups[str(text)]["fingerprints"] == prompt_fingerprints(text.read_text().splitlines())
    assert f"file {jsonl} (5 prompts)" in capsys.readouterr().out
    provenance = {"prompts": {"fingerprints": prompt_fingerprints(mine[3:4])}}
    preset = write_preset(tmp_path / "tiny-nanbeige.json", provenance, model="tiny-nanbeige")
    with pytest.raises(SystemExit) as exc:
        bench.main([*TEXT, "--prompts", str(jsonl), "--preset", str(preset)])
    assert exc.value.code == 2 and "1 of the 5 distinct evaluation prompts" in capsys.readouterr().err
    # a model without a tokenizer takes a file's token ids, and refuses its text naming the file
    ids = tmp_path / "ids.jsonl"
    ids.write_text("".join(json.dumps({"prompt": [i, i + 1, i + 2]}) + "\n" for i in range(3)))
    small = [a for a in SMALL if a not in ("random", "--prompts")]
    assert (
        bench.main([*small, "--batch-sizes", "1", "--prompts", str(ids)])["prompts"]["groups"][str(ids)]["count"] == 3
    )
    with pytest.raises(SystemExit) as exc:
        bench.main([*small, "--prompts", str(text)])
    assert exc.value.code == 2 and "no tokenizer, so its prompts must be token ids" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exc:
        bench.main([*small, "--prompts", "mine.csv"])
    assert exc.value.code == 2 and "--prompts: unknown prompt group 'mine.csv'" in capsys.readouterr().err


@pytest.mark.parametrize(
    "phases, message",
    [("8:novel", "unknown prompt group 'novel'"), ("0", "entry '0': batch size 0 must be >= 1"), ("2:", "B:GROUP")],
)
def test_bench_workload_phase_errors_name_the_entry(bench, phases, message, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, "--workload", "--workload-phases", phases])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--workload-phases" in err and message in err


def test_bench_grid_errors_name_the_flag_and_entry(bench, capsys):
    with pytest.raises(SystemExit) as exc:
        bench.main([*SMALL, "--grid", "1,1;1,7"])
    assert exc.value.code == 2 and "--grid entry '1,7': d=7 must be in 1..3" in capsys.readouterr().err


def test_controller_overhead_script_runs():
    module = load_script("bench_controller")
    for policy in ("ema", "goodput"):
        assert module.overhead_us(policy, "ouro-1.4b", [0.7, 0.87, 0.94, 1.0], 100) > 0.0


def test_plain_bench_takes_ratios_over_interleaved_rounds_with_an_aa_line(monkeypatch, capsys):
    """Paged ÷ naive is the median of per-round ratios (the first round discarded) with its spread, the A/A line
    (plain-B ÷ plain) beside it; the naive loop's decode leaves out its first token, as the engines' does (it timed
    one run of each, one after the other, and counted the naive loop's prompt forward as decode)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports common.py and bench_speculative.py
    module = load_script("bench_plain")
    argv = ["--model", FIXTURE, "--batch-sizes", "1,2", "--max-tokens", "4", "--repeats", "3", "--threads", "1"]
    results = module.main(argv)
    assert "A/A (plain-B/plain)" in capsys.readouterr().out
    for b in (1, 2):
        row = results[b]
        for stat in (row["paged_vs_naive"], row["aa"]):
            assert len(stat["per_round"]) == 2 and stat["min"] <= stat["median"] <= stat["max"]
        assert row["same_tokens"]
    engine = LoopedSpecEngine(FIXTURE, speculation="off", device="cpu", dtype="float32")
    prompts = [[5, 6, 7], [8, 9, 10]]
    naive, naive_tokens = module.naive_dense(engine.adapter, prompts, 4)
    paged, paged_tokens = load_script("bench_speculative").timed_generate(engine, prompts, 4)
    assert naive["decode_tokens"] == paged["decode_tokens"] == 2 * 3 and naive_tokens == paged_tokens


def test_context_bench_takes_ratios_over_interleaved_rounds_at_torchs_default_threads(monkeypatch, capsys):
    """Per context, each configuration's ratio to plain over the measured rounds (the first discarded) and the A/A
    line; --threads 0 is torch's default (it printed absolute tokens/s only, and --threads 0 crashed)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports common.py and bench_speculative.py
    module = load_script("bench_context")
    argv = ["--model", FIXTURE, "--contexts", "8,20", "--new-tokens", "3", "--rounds", "3", "--spec", "1,1"]
    results = module.main([*argv, "--compare-slots", "--threads", "0"])
    printed = capsys.readouterr().out
    assert "A/A (plain-B vs plain)" in printed and printed.count("plain slot") == 2
    assert set(results) == {8, 20}
    for row in results.values():
        assert set(row) == {"plain", "plain-B", "1,1", "plain slot", "1,1 slot"}
        for entry in row.values():
            stat = entry["ratio"]
            assert len(stat["per_round"]) == 2 and stat["min"] <= stat["median"] <= stat["max"]
        assert row["plain"]["ratio"]["median"] == 1.0


def test_context_bench_breakdown_times_gather_and_sdpa(monkeypatch, capsys):
    """--breakdown wraps attention's gather and SDPA (it wrapped `attention._sdpa`, a name that no longer exists, and
    died with an AttributeError) and puts both back when it is done."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import looped_spec.execution.attention as attention

    gather, sdpa = attention.PagedContext.gather, attention.sdpa
    module = load_script("bench_context")
    argv = ["--model", FIXTURE, "--contexts", "8", "--new-tokens", "3", "--rounds", "2", "--spec", "1,1"]
    module.main([*argv, "--breakdown", "--threads", "0"])
    assert "microseconds per decoded token: gather, SDPA" in capsys.readouterr().out
    assert attention.PagedContext.gather is gather and attention.sdpa is sdpa


def test_server_bench_takes_torchs_default_threads(monkeypatch):
    """bench_server.py --threads 0 (torch's default, as `looped-spec serve --threads 0`) computes its offline
    references and starts the server without OMP_NUM_THREADS=0 (it died in torch.set_num_threads(0))."""
    import argparse

    module = load_script("bench_server")
    args = argparse.Namespace(threads=0, model="tiny-ouro", max_tokens=3, exit_threshold=None)  # text prompts
    references = module.offline_references(args)
    assert set(references) == set(module.PROMPTS)
    started = []
    monkeypatch.setattr(module.subprocess, "Popen", lambda command, env: started.append((command, env)))
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    server = dict(model=FIXTURE, max_batch_size=2, clients=2, speculation="off", batching="step")
    module.start_server(argparse.Namespace(threads=0, **server), 1234, None, 1235)
    command, env = started[0]
    assert command[command.index("--threads") + 1] == "0" and "OMP_NUM_THREADS" not in env


def test_early_exit_bench_prints_quality_beside_speed(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports common.py and bench_speculative.py
    module = load_script("bench_early_exit")
    argv = ["--model", FIXTURE, "--prompts", "random", "--batch-sizes", "2", "--max-tokens", "3", "--repeats", "2"]
    rows = module.main([*argv, "--taus", "0.5", "--exit-at-steps", "1", "--out", str(tmp_path / "ee")])
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("$ ") and any(line.startswith("A/A (plain-B vs plain): ") for line in lines)
    header = next(line for line in lines if line.lstrip().startswith("batch")).split()
    assert header[-5:] == ["loops/tok", "depth", "agree", "prefix", "NLL"]
    names = ["full depth (plain)", "plain-B (A/A control)", "full depth + adaptive spec", "skip tau=0.5",
             "skip tau=0.5 + spec", "skip k=1", "skip k=1 + spec", "select tau=0.5", "select k=1"]  # fmt: skip
    assert [r["configuration"] for r in rows] == names
    for row in rows:  # repeats 2: one measured round
        assert row["ratio"]["min"] <= row["ratio"]["median"] <= row["ratio"]["max"]
        assert len(row["ratio"]["per_round"]) == 1
    plain, control, adaptive = rows[0], rows[1], rows[2]
    assert plain["ratio"]["median"] == 1.0 and plain["agreement"] == plain["prefix"] == 1.0
    assert plain["readout_depth"] == 4
    for full in (control, adaptive):  # greedy at full depth: equal to plain's (checked every round)
        assert full["agreement"] == 1.0 and full["nll"] == plain["nll"]
    skip, skip_spec, select = rows[5], rows[6], rows[8]
    # exit_at_step=1: the first token is read from the prompt's last position, which ran all 4 loops
    assert skip["loops_per_token"] == skip_spec["loops_per_token"] == (4 + 1 + 1) / 3
    assert select["loops_per_token"] == 4
    for twin in (rows[4], skip_spec):  # + spec: the same early-exit model, so the same greedy output (checked)
        assert twin["agreement"] == rows[rows.index(twin) - 1]["agreement"]
    assert skip["readout_depth"] == select["readout_depth"] == 1
    assert all(r["nll"] > 0 and 0 <= r["agreement"] <= 1 and r["tokens_per_s"] > 0 for r in rows)
    data = json.loads((tmp_path / "ee.json").read_text())
    assert data["rows"] == json.loads(json.dumps(rows)) and "--taus" in data["command"] and data["depth"] == 4
    batch = data["batch_sizes"]["2"]
    assert batch["aa"] == control["ratio"] and batch["noise_floor"] >= 0
    assert len(batch["rounds"]) == len(batch["orders"]) == 2 and set(batch["rounds"][0]) == set(data["configs"])
    assert batch["equality_checks"] == 2 * 4  # plain-B, adaptive and the two "+ spec" twins, each round


def test_results_table_renders_a_committed_result(capsys):
    table = load_script("results_table")
    # the run that decided the change detector's removal: per B, confirmation, workload and an A/B engine
    table.main([str(ROOT / "benchmarks" / "results" / "ab-change-detector.json")])
    printed = capsys.readouterr().out
    assert printed.startswith("**tiny-ouro (D=4)**") and "| 32 |" in printed and "Changing workload" in printed
    assert "Confirmation rounds" in printed and "Workload confirmation" in printed
    assert "A/B, adaptive[change_z=none] ÷ adaptive per round: B = 1: " in printed and "workload: " in printed


def test_results_table_ab_line_divides_the_two_engines_ratios_round_by_round():
    table = load_script("results_table")
    variant = {"median": 1.1, "min": 1.0, "max": 1.4, "per_round": [1.0, 1.1, 1.4]}
    base = {"median": 1.0, "min": 0.5, "max": 2.0, "per_round": [0.5, 1.0, 2.0]}
    assert table.per_round_quotient(variant, base) == table.fmt({"median": 1.1, "min": 0.7, "max": 2.0})
    assert table.per_round_quotient(None, base) == "-"


def test_early_exit_bench_quality_only_runs_no_timing_and_is_deterministic(monkeypatch, tmp_path, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = load_script("bench_early_exit")
    argv = ["--model", FIXTURE, "--prompts", "random", "--batch-sizes", "2", "--max-tokens", "3", "--quality-only"]
    argv += ["--taus", "0.5", "--exit-at-steps", "1", "--repeats", "1"]  # --repeats does not apply
    rows = module.main([*argv, "--out", str(tmp_path / "q")])
    printed = capsys.readouterr().out
    assert "A/A" not in printed and "tok/s" not in printed and "quality only, no timing" in printed
    header = next(line for line in printed.splitlines() if line.lstrip().startswith("batch")).split()
    assert header[-5:] == ["loops/tok", "depth", "agree", "prefix", "NLL"]
    names = ["full depth (plain)", "skip tau=0.5", "skip k=1", "select tau=0.5", "select k=1"]
    assert [r["configuration"] for r in rows] == names
    assert all("ratio" not in r and "tokens_per_s" not in r for r in rows)
    plain, skip, select = rows[0], rows[2], rows[4]
    assert plain["agreement"] == plain["prefix"] == 1.0 and plain["readout_depth"] == 4
    assert skip["loops_per_token"] == (4 + 1 + 1) / 3 and select["loops_per_token"] == 4
    data = json.loads((tmp_path / "q.json").read_text())
    assert data["rows"] == json.loads(json.dumps(rows))
    assert set(data["batch_sizes"]["2"]["runs"]) == set(data["configs"])
    assert module.main(argv) == rows  # one untimed pass: the same numbers every time


def test_overhead_bench_compares_adaptive_with_and_without_readouts(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # it imports bench_speculative.py
    module = load_script("bench_overhead")
    argv = ["--model", FIXTURE, "--prompts", "random", "--batch-size", "2", "--rounds", "3", "--max-tokens", "3"]
    results = module.main(argv)
    assert set(results) == {"plain-B", "adaptive", "adaptive few-readouts", "adaptive no-readouts"}
    assert all(ratio > 0.0 and se >= 0.0 for ratio, se in results.values())
    printed = capsys.readouterr().out
    assert "(rotating)" in printed and "µs/round" in printed
    engine = module.adaptive_engine(load_adapter(FIXTURE), "none")
    plans = [engine.controller.plan(2, 10.0).measure_depths for _ in range(100)]
    assert plans[0] and not any(plans[1:])  # the first round reads out, none after it


@pytest.mark.parametrize(
    "name, extra", [("bench_overhead", []), ("bench_interleave", ["--grid", "1,1", "--modes", "slice"])]
)
def test_timing_benchmarks_decode_a_batch_above_32_at_once(name, extra, monkeypatch):
    """--batch-size B is the batch every engine decodes: with the engine's default max_batch_size (32) a B of 33 ran
    as a wave of 32 and one of 1, timed as if it were B = 33."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # they import bench_speculative.py
    module = load_script(name)
    built = []

    class Recorded(LoopedSpecEngine):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            built.append(self)

    monkeypatch.setattr(module, "LoopedSpecEngine", Recorded)
    module.main(["--model", FIXTURE, "--prompts", "random", "--batch-size", "33", "--rounds", "3", "--max-tokens", "2"]
                + extra)  # fmt: skip
    assert len(built) >= 3 and all(max(engine.stats.batch_size_histogram) == 33 for engine in built)


def test_adaptation_rounds_summarises_when_a_phase_moved_and_settled():
    summary = load_script("adaptation_rounds").phase_summary
    assert summary(["2,1", "2,1", "3,1", "3,1", "3,1"], "2,1") == (2, 2, "3,1", 0.6)
    assert summary(["0,0", "0,0"], "0,0") == (None, 0, "0,0", 1.0)  # never moved
    assert summary(["1,1", "0,0", "0,0"], None) == (0, 1, "0,0", pytest.approx(2 / 3))  # the first phase


def test_adaptation_rounds_reports_every_phase_of_every_repeat(tmp_path, capsys):
    script = load_script("adaptation_rounds")
    script.main(["--model", FIXTURE, "--workload-phases", "1:code,2:prose", "--repeats", "2", "--max-tokens", "6"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    assert [(r[0], r[1]) for r in rows] == [("0", "1:code"), ("0", "2:prose"), ("1", "1:code"), ("1", "2:prose")]
    assert all(1 <= int(r[2]) <= 5 for r in rows)  # 6 tokens: the prefill's, then 1-5 decode rounds
    # a phase of a prompt file of one's own is named by the file's name (its folder would push the columns out)
    own = tmp_path / "deeply" / "nested" / "my-prompts.jsonl"
    own.parent.mkdir(parents=True)
    own.write_text("".join(json.dumps({"prompt": [5 + i, 9, 11]}) + "\n" for i in range(4)))
    script.main(["--model", FIXTURE, "--workload-phases", f"1:code,2:{own}", "--repeats", "1", "--max-tokens", "6"])
    header, *rows = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[1] for line in rows] == ["1:code", "2:my-prompts.jsonl"] and "nested" not in header
    assert len({line.index(line.split()[2]) + len(line.split()[2]) for line in rows}) == 1  # rounds, right-aligned


def test_adaptation_rounds_prints_a_results_oracle_beside_the_phases_it_was_chosen_for_only(tmp_path, capsys):
    """The oracle of a bench_speculative.py --workload result is per phase: beside phases of other batch sizes or
    other text it would say which plan was best for a phase that did not run. Refused, naming --result."""
    script = load_script("adaptation_rounds")
    result = tmp_path / "result.json"
    workload = {"phases": [1, 2], "phase_groups": ["eval", "eval"], "oracle_phases": ["1,1", "plain"]}
    result.write_text(json.dumps({"workload": workload}))
    argv = ["--model", FIXTURE, "--repeats", "1", "--max-tokens", "3", "--result", str(result)]
    for phases in ("1:code,2:prose", "2:eval,1:eval", "1:eval"):  # other text, other order, fewer phases
        with pytest.raises(SystemExit, match=f"ran the phases 1:eval,2:eval, --workload-phases gives {phases};"):
            script.main([*argv, "--workload-phases", phases])
    workload.pop("phase_groups")  # a result written before B:GROUP phases: its batch sizes
    result.write_text(json.dumps({"workload": workload}))
    with pytest.raises(SystemExit, match="ran the phases 1,2, --workload-phases gives 1,8;"):
        script.main([*argv, "--workload-phases", "1:eval,8:eval"])
    capsys.readouterr()
    script.main([*argv, "--workload-phases", "1:code,2:prose"])
    assert [line.split()[-1] for line in capsys.readouterr().out.splitlines()[2:]] == ["1,1", "plain"]


def test_loop_batching_bench_reports_every_mode_beside_an_aa_line(tmp_path, capsys):
    bench = load_script("bench_loop_batching")
    out = tmp_path / "loop.json"
    table = bench.main(["--model", FIXTURE, "--prompts", "random", "--batch-size", "2", "--modes", "full,tau0.5,step1",
                        "--rounds", "3", "--max-tokens", "4", "--speculation", "2,1", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert set(table) == {"full", "tau0.5", "step1"} and "A/A" in printed and "speculation 2,1" in printed
    # exits run no rounds: generated tokens at depth 1 (a first token comes from the prompt's full-depth prefill)
    assert table["step1"]["loops_per_token"] < table["full"]["loops_per_token"]
    written = json.loads(out.read_text())
    assert written["table"]["full"]["positions_per_pass"] > 2  # a verification's K+1 positions
    # each engine's time splits into the adapter's stages and host work: both parts there, the host part reported
    for engine in ("step", "loop"):
        assert all(0 < r[engine]["model_seconds"] < r[engine]["seconds"] for r in written["rounds"]["full"])
        assert table["full"]["host_us_per_token"][engine] > 0
    with pytest.raises(SystemExit):
        bench.main(["--model", FIXTURE, "--prompts", "random", "--modes", "deep", "--rounds", "3"])


def test_draft_confidence_auc_ranks_and_reports_every_depth(tmp_path, capsys):
    script = load_script("draft_confidence_auc")
    assert script.auc([0.9, 0.8], [0.1, 0.2]) == 1.0 and script.auc([0.1], [0.9, 0.8]) == 0.0
    assert script.auc([0.5, 0.5], [0.5]) == 0.5 and script.auc([], [0.3]) is None
    assert script.auc([0.3, 0.7], [0.5]) == 0.5  # one above, one below
    out = tmp_path / "auc.json"
    table = script.main(["--model", FIXTURE, "--prompts", "random", "--count", "3", "--max-tokens", "6",
                         "--out", str(out)])  # fmt: skip
    assert sorted(table) == [1, 2, 3] and all(row["positions"] == 18 for row in table.values())
    assert "AUC exit signal" in capsys.readouterr().out and json.loads(out.read_text())["table"]


def test_prefix_cache_bench_prints_its_aa_line_and_checks_outputs(tmp_path, capsys):
    script = load_script("bench_prefix_cache")
    out = tmp_path / "pc.json"
    result = script.main(["--model", "tiny-ouro", "--batch-size", "2", "--shared-tokens", "40", "--own-tokens", "4",
                          "--max-tokens", "3", "--rounds", "2", "--out", str(out)])  # fmt: skip
    printed = capsys.readouterr().out
    assert "A/A   plain ÷ plain-B" in printed and "cache plain ÷ cached" in printed
    assert result["outputs_identical"] and json.loads(out.read_text())["outputs_identical"]
    hits, queries = result["cached_prompt_tokens"]
    assert 0 < hits < queries


def test_structured_acceptance_counts_drafts_per_grammar(capsys):
    script = load_script("structured_acceptance")
    table = script.main(["--models", "tiny-ouro", "--plans", "2,1", "--prompts", "2", "--max-tokens", "6"])
    counts = table["tiny-ouro", "2,1"]
    assert len(counts) == len(script.GRAMMARS) and all(0 <= accepted <= drafted for accepted, drafted in counts)
    assert sum(drafted for _, drafted in counts) > 0 and "| tiny-ouro | (2,1) |" in capsys.readouterr().out


def test_replay_batches_prices_each_round_at_the_batch_size_it_had():
    """Two requests of 9 tokens (8 bits each): one whose draft always agrees (K = 2 commits 3 a round: 3 rounds
    (3, 3, 2)), one whose draft never does (1 a round: 8 rounds). Rounds cost 1 + b: the batch takes 3 rounds at
    b = 2 and 5 at b = 1; at steady state the mean 5.5 rounds at b = 2; plain 8 rounds at b = 2."""

    class Cost:
        def seconds(self, k, d, b, context):
            return 1.0 + b

    replay = load_script("replay_batches").replay
    bits = [[[1] * 8, [0] * 8]]  # depth 1: two requests
    assert replay(bits, [0, 1], 2, 1, Cost(), 0.0) == (3 * 3.0 + 5 * 2.0, 5.5 * 3.0, 11 / 16)
    assert replay(bits, [0, 1], 0, 0, Cost(), 0.0) == (8 * 3.0, 8 * 3.0, 1.0)


def test_replay_batches_prints_every_plan_with_a_fill_below_plain(capsys):
    load_script("replay_batches").main(
        ["--model", FIXTURE, "--prompts", "random", "--batch-sizes", "2", "--grid", "1,1;2,1", "--max-tokens", "8",
         "--batches", "3"]
    )  # fmt: skip
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == ["1,1", "2,1"]
    assert all(0.0 < float(r[1]) and 0.0 < float(r[2]) and 0.0 < float(r[3]) <= 1.0 for r in rows)


def test_replay_controller_drives_a_controller_over_recorded_bits():
    """Two requests of 8 committed tokens: one whose depth-1 draft always agrees (K = 2 commits 3, 3, 2), one whose
    draft never does (1 a round). Rounds cost 1 + b: 3 rounds at b = 2, 5 at b = 1. A measured round reports the
    committed positions' bits: the first request's all agree at depth 1, the second's none."""
    module = load_script("replay_controller")

    class Cost:
        def seconds(self, k, d, b, context):
            return 1.0 + b

        def measure_seconds(self, k, d, b, read=None):
            return 0.0

    class Recording(FixedController):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.reports = []

        def _learn(self, feedback):
            self.reports.append(feedback)

    bits = [[[1] * 8, [0] * 8], [[1] * 8, [1] * 8]]  # [depth][request][position]; depth 2 is the full depth
    machine = module.Machine(Cost(), noise=0.0, speculative_price=1.0, measure_overhead=0.0, seed=0)
    out = module.drive(FixedController(2, 1), bits, [[0, 1]], machine, 100.0)
    assert out == {"tokens": 16, "seconds": 3 * 3.0 + 5 * 2.0, "rounds": 8, "speculative": 8, "measured": 0,
                   "plans": {(2, 1): 8}}  # fmt: skip
    recording = Recording(2, 1, measure_depths=True)
    out = module.drive(recording, bits, [[0, 1]], machine, 100.0)
    assert out["measured"] == 8 and out["tokens"] == 16
    first = recording.reports[0]
    assert first.num_accepted == [2, 0] and first.request_trials == [3, 1]
    assert first.request_matches == [[3, 3], [0, 1]] and first.depth_matches == [3, 4]
    assert sum(r.depth_trials[0] for r in recording.reports) == 16


def test_replay_controller_prints_every_configuration_against_plain(capsys):
    results = load_script("replay_controller").main(
        ["--model", FIXTURE, "--prompts", "random", "--batch-sizes", "2", "--grid", "1,1", "--max-tokens", "6",
         "--batches", "2", "--seeds", "2", "--policies", "default,default:prior_share=0.125"]
    )  # fmt: skip
    assert list(results[2]) == ["plain", "1,1", "adaptive", "adaptive[prior_share=0.125]"]
    assert all(len(rates) == 2 and min(rates) > 0.0 for rates in results[2].values())
    rows = [line.split() for line in capsys.readouterr().out.splitlines() if line.startswith("  ")]
    assert [r[0] for r in rows] == list(results[2]) and rows[0][1] == "1.000x"


@pytest.mark.parametrize("k,d", [(0, 0), (1, 1), (3, 1), (2, 2)])
def test_replay_controller_prices_fixed_plans_as_replay_batches_does(k, d):
    """An independent reference: replay_batches.py replays a fixed plan with the tuner's `simulate_tokens`; the
    controller replay of a FixedController must give the same seconds over the same batches (no noise, no readouts)."""
    import random

    controllers = load_script("replay_controller")
    reference = load_script("replay_batches").replay

    class Cost:
        def seconds(self, k, d, b, context):
            return 1.0 + 0.5 * b + 0.25 * k + 0.125 * d

        def measure_seconds(self, k, d, b, read=None):
            return 0.0

    rng = random.Random(5)
    depth, prompts = 3, 6
    lengths = [rng.randint(3, 12) for _ in range(prompts)]
    bits = [[[int(rng.random() < a) for _ in range(n)] for n in lengths] for a in (0.6, 0.8, 1.0)]  # depth 3: full
    assert len(bits) == depth
    batches = [[0, 1, 2], [3, 4, 5], [1, 3, 5, 0]]
    machine = controllers.Machine(Cost(), noise=0.0, speculative_price=1.0, measure_overhead=0.0, seed=0)
    out = controllers.drive(FixedController(k, d), bits, batches, machine, 40.0)
    want = sum(reference(bits, batch, k, d, Cost(), 40.0)[0] for batch in batches)
    assert out["seconds"] == pytest.approx(want, rel=1e-12)
    assert out["tokens"] == sum(lengths[p] for batch in batches for p in batch)


def test_replay_controller_switches_prompt_groups_every_few_batches():
    batches = load_script("replay_controller").rotating_batches(5, 2, offsets=[0, 10], counts=[10, 3], switch_every=2)
    # batches 0, 1 from the first group (indices 0..9), 2, 3 from the second (10..12), 4 from the first again
    assert batches == [[0, 1], [7, 8], [10 + 14 % 3, 10 + 15 % 3], [10 + 21 % 3, 10 + 22 % 3], [8, 9]]


def test_plan_prices_writes_a_table_the_replay_charges(tmp_path, capsys):
    """plan_prices.py times each plan's rounds next to plain's and writes "K,d@B" -> price; replay_controller.py
    --price-table charges each plan its price at the nearest batch size measured, a plan not measured its nearest
    one's (by draft depth, then K); a table for another model is refused, naming the file."""
    out = tmp_path / "prices.json"
    table = load_script("plan_prices").main(
        ["--model", FIXTURE, "--prompts", "random", "--grid", "1,1;2,2", "--batch-sizes", "1,2", "--tokens", "12",
         "--repeats", "2", "--out", str(out)]
    )  # fmt: skip
    assert json.loads(out.read_text()) == table and table["model"] == "ouro-tiny"
    assert set(table["prices"]) == {"1,1@1", "1,1@2", "2,2@1", "2,2@2"}
    assert all(p > 0.0 for p in table["prices"].values()) and table["rounds"]["0,0@1"] >= 3
    assert "1,1" in capsys.readouterr().out
    replay = load_script("replay_controller")
    args = ["--model", FIXTURE, "--prompts", "random", "--batch-sizes", "2", "--grid", "1,1", "--max-tokens", "6"]
    results = replay.main([*args, "--batches", "2", "--seeds", "1", "--price-table", str(out)])
    assert min(min(rates) for rates in results[2].values()) > 0.0

    class Cost:
        def seconds(self, k, d, b, context):
            return 1.0

        def measure_seconds(self, k, d, b, read=None):
            return 0.0

    prices = {"1,1@1": 1.5, "3,1@1": 1.25, "1,2@8": 0.75, "3,3@8": 0.5}
    machine = replay.Machine(Cost(), noise=0.0, speculative_price=9.0, measure_overhead=0.0, seed=0, prices=prices)
    assert machine.seconds(1, 1, 2, 100.0, False) == 1.5  # B = 2 is nearer 1 than 8
    assert machine.seconds(4, 1, 1, 100.0, False) == 1.25  # not measured: depth 1, K 3 the nearest
    assert machine.seconds(2, 1, 1, 100.0, False) == 1.5  # K 1 and 3 equally near: the smaller
    assert machine.seconds(2, 2, 6, 100.0, False) == 0.75 and machine.seconds(0, 0, 6, 100.0, False) == 1.0
    assert machine.seconds(1, 3, 32, 100.0, False) == 0.5
    other = tmp_path / "other.json"
    other.write_text(json.dumps({**table, "model": "tiny-ouro"}))
    with pytest.raises(SystemExit):
        replay.main(["--model", FIXTURE, "--prompts", "random", "--price-table", str(other)])
    assert str(other) in capsys.readouterr().err


PROMPT_SCRIPTS = ["adaptation_rounds", "bench_early_exit", "bench_interleave", "bench_loop_batching", "bench_overhead",
                  "draft_confidence_auc", "plan_prices", "replay_batches", "replay_controller"]  # fmt: skip


@pytest.mark.parametrize("name", PROMPT_SCRIPTS)
def test_every_benchmark_takes_a_prompt_group_or_file_and_names_a_bad_one(name, capsys, monkeypatch):
    """One prompt-source parser for every benchmark (looped_spec.tuning.grid): a group or a .txt / .jsonl file of
    one's own; an unknown group is a usage error naming --prompts, before any model loads."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run as a script: its siblings import
    with pytest.raises(SystemExit) as exc:
        load_script(name).main(["--prompts", "novel"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--prompts" in err and "unknown prompt group 'novel'" in err
    assert "or a .txt or .jsonl prompt file" in err


def test_bench_default_model_is_the_repositorys_fixture_wherever_it_runs(bench, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # not the repository: a relative tests/fixtures/ouro-tiny would name nothing here
    assert Path(bench.parse_args(["--repeats", "2"]).model) == Path(FIXTURE)


@pytest.mark.parametrize(
    "name, argv, message",
    [
        ("replay_controller", ["--batch-sizes", "0"], "--batch-sizes entry '0': must be >= 1"),
        ("replay_controller", ["--grid", "0,1"], "--grid entry '0,1': K=0 must be in 1..64"),
        ("replay_controller", ["--policies", "bogus"], "--policies: unknown policy 'bogus'"),
        ("replay_controller", ["--policies", "default:decision_interval=-1"], "decision_interval=-1 must be in [1,"),
        ("replay_controller", ["--policies", "default,none"], "'none' (no adaptive engine) cannot be listed with"),
        (
            "replay_controller",
            ["--policies", "ema:hysteresis=0.1"],
            "'ema:hysteresis=0.1': hysteresis: only the goodput",
        ),
        ("bench_speculative", ["--policies", "ema:decision_interval=8"], "decision_interval: only the goodput policy"),
        ("replay_controller", ["--model", "nosuch"], "--model nosuch: not a checkpoint folder nor a shipped model"),
        ("replay_controller", ["--preset", "nosuch.json"], "--preset nosuch.json: no such preset file"),
        ("replay_controller", ["--prompts", "{empty}"], "--prompts: {empty} holds no prompts"),
        ("replay_controller", ["--prompts", "code,{empty}"], "--prompts entry '{empty}': {empty} holds no prompts"),
        ("plan_prices", ["--model", "nosuch"], "--model nosuch: not a checkpoint folder nor a shipped model"),
        ("plan_prices", ["--preset", "nosuch.json"], "--preset nosuch.json: no such preset file"),
        ("plan_prices", ["--prompts", "{empty}"], "--prompts: {empty} holds no prompts"),
        ("plan_prices", ["--out", "{dir}"], "--out {dir}: is a directory"),
        ("plan_prices", ["--out", "{empty}/x.json"], "--out {empty}/x.json: {empty} is not a directory"),
        ("bench_overhead", ["--model", "nosuch"], "--model nosuch: not a checkpoint folder nor a shipped model"),
        ("bench_plain", ["--model", "nosuch"], "--model nosuch: not a checkpoint folder nor a shipped model"),
        ("bench_overhead", ["--threads", "-1"], "--threads >= 0"),
        ("bench_speculative", ["--threads", "-1"], "--threads must be >= 0 (0: torch's default)"),
        ("bench_overhead", ["--prompts", "{empty}"], "--prompts: {empty} holds no prompts"),
        ("bench_speculative", ["--model", "nosuch"], "--model nosuch: not a checkpoint folder nor a shipped model"),
        ("bench_speculative", ["--preset", "nosuch.json"], "--preset nosuch.json: no such preset file"),
        ("bench_speculative", ["--stop-margins", "x"], "--stop-margins entry 'x': expected a number"),
        ("bench_speculative", ["--policies", "default,none"], "'none' (no adaptive engine) cannot be listed with"),
        ("bench_speculative", ["--policies", "default:decision_interval=0"], "decision_interval=0 must be in"),
        (
            "bench_speculative",
            ["--workload", "--workload-phases", "1:{empty}"],
            "--workload-phases entry '1:{empty}': {empty} holds no prompts",
        ),
        ("bench_speculative", ["--out", "{dir}/x.json", "--grid", "1,1"], "--out {dir}/x.json: is a directory"),
    ],
)
def test_benchmark_flag_errors_name_the_flag_before_any_model_loads(name, argv, message, tmp_path, capsys, monkeypatch):
    """A bad flag is a usage error (exit 2, no traceback) that names it, before a model's weights are read: a check
    that waited for the model, or for the timed rounds (an --out it cannot write), would cost a run to find."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run as a script: its siblings import

    def no_model(*args, **kwargs):
        raise AssertionError("a model's weights were read before the flags were checked")

    monkeypatch.setattr("looped_spec.models.adapter.read_tensors", no_model)
    empty = tmp_path / "empty.txt"
    empty.write_text("\n  \n")  # blank lines only: no prompt
    (tmp_path / "x.json").mkdir()

    def fill(text: str) -> str:
        return text.replace("{empty}", str(empty)).replace("{dir}", str(tmp_path))

    with pytest.raises(SystemExit) as exc:
        load_script(name).main(["--model", FIXTURE, *[fill(a) for a in argv]])
    assert exc.value.code == 2 and fill(message) in capsys.readouterr().err


def test_replay_controller_checks_the_grid_against_the_depth_before_measuring(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    module = load_script("replay_controller")
    monkeypatch.setattr(module, "measure_match_bits", lambda *a, **k: pytest.fail("bits measured"))
    with pytest.raises(SystemExit) as exc:
        module.main(["--model", FIXTURE, "--prompts", "random", "--grid", "1,9", "--batch-sizes", "1"])
    assert exc.value.code == 2 and "--grid entry '1,9': d=9 must be in 1..3" in capsys.readouterr().err


def test_replay_and_overhead_refuse_the_presets_tuning_prompts(monkeypatch, capsys):
    """As bench_speculative.py does: the shipped preset was tuned on (part of) the 'tune' group, so replaying or timing
    it there scores it on its own tuning prompts; refused (exit 2) before anything is measured."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    replay = load_script("replay_controller")
    monkeypatch.setattr(replay, "measure_match_bits", lambda *a, **k: pytest.fail("bits measured"))
    with pytest.raises(SystemExit) as exc:
        replay.main(["--model", "tiny-ouro", "--prompts", "tune", "--batch-sizes", "1", "--max-tokens", "4"])
    assert exc.value.code == 2 and "were also used for tuning" in capsys.readouterr().err
    overhead = load_script("bench_overhead")
    monkeypatch.setattr(overhead, "timed_slices", lambda *a, **k: pytest.fail("rounds timed"))
    with pytest.raises(SystemExit) as exc:
        overhead.main(["--model", "tiny-ouro", "--prompts", "tune", "--rounds", "3", "--max-tokens", "3"])
    assert exc.value.code == 2 and "were also used for tuning" in capsys.readouterr().err


def test_device_run_refuses_an_unknown_mode(tmp_path):
    """A mistyped mode of benchmarks/device_run.sh is an error naming it, before anything runs (it ran the full
    session, longer than the device timeout a shorter mode is given)."""
    import subprocess

    out = tmp_path / "gpu"
    done = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh"), "hugin"], cwd=ROOT,
                          env={"PATH": "/usr/bin:/bin", "OUT": str(out)}, capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 2 and "unknown mode 'hugin'" in done.stderr, done.stdout + done.stderr
    assert not out.exists()
    usage = subprocess.run(["bash", str(ROOT / "benchmarks" / "device_run.sh"), "--help"], cwd=ROOT,
                           env={"PATH": "/usr/bin:/bin", "OUT": str(out)}, capture_output=True, text=True)  # fmt: skip
    assert usage.returncode == 0 and "huginn" in usage.stdout and not out.exists()


def test_the_gpu_checks_cpu_mode_names_every_path_that_is_not_token_identical(monkeypatch):
    """CI runs gpu_check.py --device cpu --tiny (fp32), where every path gives the same tokens: a count below its
    requests fails the run, naming it (it exited 0 with the count in its report)."""
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as when run as a script: its siblings import
    gpu_check = load_script("gpu_check")
    same = {"requests": 4, "eager_vs_reference_identical_requests": 4, "graphs_vs_eager_identical_requests": 4,
            "speculative_vs_plain_identical_requests": {"2,1": 4},
            "early_exit_speculative_vs_plain_identical_requests": {"3,1": 4}}  # fmt: skip
    report = {"models": {"a": {"correctness": same, "loop_batching": {"greedy": {"identical_requests": 4, "of": 4}}},
                         "b": {"skipped": "time budget spent"}}}  # fmt: skip
    assert gpu_check.mismatches(report) == []
    report["models"]["a"]["correctness"] = same | {"speculative_vs_plain_identical_requests": {"2,1": 3}}
    report["models"]["a"]["loop_batching"]["greedy"]["identical_requests"] = 2
    assert gpu_check.mismatches(report) == [
        "a: speculative_vs_plain_identical_requests 2,1 3 of 4",
        "a: loop batching greedy 2 of 4",
    ]
