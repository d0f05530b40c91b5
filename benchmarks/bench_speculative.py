"""Plain vs fixed (K, d) vs adaptive speculation, side by side, interleaved, with an A/A noise line.

One persistent engine per configuration, all on one loaded model: `plain`, `plain-B` (a second plain engine:
the A/A control), every grid cell `K,d` (a fixed `SpeculativeConfig(k, d)`) and every adaptive policy asked
for. For each batch size B the benchmark runs `--repeats` rounds; in each round every configuration decodes
the same B prompts once (greedy, `--max-tokens` new tokens each, eos ignored), and the rounds rotate through the
prompt set (round n of the run from offset 7n: `PromptPool`; `--same-prompts`: every round the first B). The
first round is a warm-up and is discarded. Within a round all configurations decode at once, taking turns of at
least `--slice-ms` (20 ms) of engine steps in an order shuffled every turn, so they share whatever speed the
machine has at that moment (docs/benchmarking.md); `--slice-ms 0` runs them one whole `generate` after another in
a shuffled order instead.

Ratios are taken within a round: (config decode tokens/s) / (plain decode tokens/s of the same round); the
table shows their median over the measured rounds and their spread, [min-max] of those per-round ratios,
and beside them a best-of ratio (fastest measured run of the config / fastest measured run of plain), which
a shared machine's slowdowns disturb least. "Best fixed" is the cell with the best median ratio; being the
best of many noisy cells on the same rounds flatters it, so adaptive is also compared with a held-out choice:
in each measured round, the cell that is best on the other rounds (likewise the per-phase oracle).
`--confirm-repeats N` adds a confirmation stage per batch size: N more interleaved rounds of plain, plain-B, the
screen's `--confirm-top` best fixed cells and the adaptive engines only. The screen picked its best cell with its
own noise; measured again in rounds that took no part in the choice, that cell's ratio is not flattered, and with
a handful of configurations a round is short, so the comparisons the acceptance criteria are about get more
rounds for the same time. With `--workload` the workload gets one too: plain, plain-B, the screen's best single
fixed cell, the screen's per-phase oracle (each phase on the engine the screen chose for it, sharing that
engine's run of the phase when it is in the round anyway) and adaptive.
Decode time = the wall time of a run's turns (or of its `generate`) minus its prefill time; decode tokens =
generated tokens - B (the first token of a request comes from prefill). Every speculative and adaptive output
is checked token for token against plain's output of the same round.

`--workload` also runs the changing workload (`--workload-phases`, default 1->8->32->8->1; one batch per
phase) on every configuration, each phase interleaved and repeated the same way, and compares adaptive with the
per-phase oracle (each phase at its best of plain and the fixed cells by median phase time, times summed per
round), with the best single fixed cell and with plain. A phase is `B` or `B:GROUP` (`looped_spec.tuning.grid.
parse_phases`): `--workload-phases 8:eval,8:code,32:prose,8:eval` switches the text mid-run between prompt
groups; a phase without a group decodes `--prompts`. The phases of one group read consecutive slices of that
group's prompts (rotated by round like the batch sizes'); the result reports each phase's group.

    python benchmarks/bench_speculative.py --model tiny-ouro --batch-sizes 1,8,32 --workload \
        --out benchmarks/results/tiny-ouro
    python benchmarks/bench_speculative.py --model tests/fixtures/ouro-tiny --prompts random --max-tokens 8 \
        --repeats 2 --batch-sizes 1,2
    python benchmarks/bench_speculative.py --model tiny-ouro --batch-sizes 1 --workload \
        --workload-phases 8:eval,8:code,32:prose,8:eval     # text of another kind, mid-run

Prompts: `--prompts eval` (default) is `looped_spec.tuning.prompt_sets`' evaluation group, disjoint from the tuning
group; `code` (torch's sources) and `prose` (Python reference documentation) are evaluation groups of other kinds
of text; `--prompts my-text.jsonl` (a "prompt" a line) or `my-text.txt` (a prompt a line) evaluates on text of
your own, and a workload phase may name such a file as its group (`8:eval,8:my-text.jsonl`). The benchmark exits
with status 2 when an adaptive engine's preset records (provenance["prompts"]["fingerprints"]) any of the prompts it
is about to use, those of every workload phase included. A checkpoint without a tokenizer gets random token ids
(every group, one pool; a prompt file must hold token ids there). `--grid` and `--batch-sizes` are parsed by
`looped_spec.tuning.grid`, as `looped-spec tune` parses them (the same `auto`).
"""

from __future__ import annotations

import argparse
import json
import random
import shlex
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig
from looped_spec.cli.flag_errors import flags_of, name_flags
from looped_spec.control.controller import DEFAULT_POLICY, POLICIES, AdaptiveController
from looped_spec.control.settings import ControlSettings
from looped_spec.presets.lookup import find_preset, preset_path, read_preset_file
from looped_spec.tuning.grid import Phase, parse_batch_sizes, parse_grid, parse_phases, prompt_source_flag
from looped_spec.tuning.inputs import parse_adapter_options
from looped_spec.tuning.prompt_sets import (
    PromptSetError,
    has_tokenizer,
    is_prompt_file,
    load_prompts,
    prompt_fingerprints,
    prompt_group,
    read_prompt_file,
)

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its siblings import it; it imports common.py
from common import (  # noqa: E402
    check_model,
    check_out_path,
    check_preset,
    check_prompt_source,
    load_model,
    refuse_tuning_prompts,
)

#: the repository's root: the default model is its test fixture, wherever the script is run from
ROOT = Path(__file__).resolve().parent.parent

SPREAD = (
    "±half the width of the median's ~95 % confidence interval and [min-max] of the per-round ratios over the "
    "measured rounds (first round discarded)"
)
BEST_OF = "best-of = fastest measured run of the config / fastest measured run of plain (robust to slowdowns)"


class OutputMismatch(AssertionError):
    """A speculative or adaptive greedy output differed from plain decoding's (an engine bug)."""


# ----------------------------------------------------------------------------------------- inputs
def parse_policies(text: str) -> list[tuple[str | None, tuple[tuple[str, Any], ...]]]:
    """'default' (the engine's default policy: no policy argument), 'ema', 'goodput'; 'none' (alone) = no adaptive. Each
    may change the controller's tunables (`ControlSettings` fields) for an A/B in one process:
    'default:readout_budget=0.01' or 'default:plain_margin=0.1+hysteresis=0' (several joined by '+'; 'none' = None).

    Every name and change is checked here, before a model loads: an unknown policy, or a value `ControlSettings`
    refuses, is a ValueError naming --policies and the entry."""
    out: list[tuple[str | None, tuple[tuple[str, Any], ...]]] = []
    fields = set(ControlSettings.__dataclass_fields__)
    items = [p.strip().lower() for p in text.split(",") if p.strip()]
    if "none" in items and len(items) > 1:  # "none" means no adaptive engine at all: no other policy can run beside it
        raise ValueError(
            f"--policies {text!r}: 'none' (no adaptive engine) cannot be listed with other policies; give 'none' "
            "alone, or leave it out"
        )
    for item in items:
        if item == "none":
            return []
        name, _, changes = item.partition(":")
        if name != "default" and name not in POLICIES:
            raise ValueError(f"--policies: unknown policy {name!r} (default, {', '.join(POLICIES)}, none)")
        settings = []
        for change in (x for x in changes.split("+") if x):
            key, sep, value = change.partition("=")
            if not sep or key not in fields:
                raise ValueError(f"--policies {item!r}: {change!r} is not FIELD=VALUE of {sorted(fields)}")
            try:
                settings.append((key, None if value == "none" else json.loads(value)))
            except ValueError:
                raise ValueError(
                    f"--policies {item!r}: {key}={value!r} is not a JSON value (several changes join with '+')"
                ) from None
        try:
            control = ControlSettings(**dict(settings))  # the engine would refuse it only once the model is loaded
        except ValueError as exc:
            raise ValueError(f"--policies {item!r}: {exc}") from None
        # a tunable the policy does not read: the engine refuses it once loaded, and replay_controller.py's controllers
        # (built without an engine) would run with it silently ignored
        unused = control.set_for_another_policy(DEFAULT_POLICY if name == "default" else name)
        if unused:
            raise ValueError(f"--policies {item!r}: {', '.join(unused)}: only the goodput policy reads "
                             f"{'it' if len(unused) == 1 else 'them'}")  # fmt: skip
        policy = (None if name == "default" else name, tuple(settings))
        if policy not in out:
            out.append(policy)
    return out


def adaptive_name(policy: str | None, settings: tuple[tuple[str, Any], ...]) -> str:
    name = "adaptive" if policy is None else f"adaptive-{policy}"
    return name + "".join(f"[{key}={'none' if value is None else value}]" for key, value in settings)


def prompt_source(group: str, adapter) -> str:
    """What a group decodes on `adapter`: the group, or "random" (token ids) when the model has no tokenizer. A
    prompt file is decoded as it is (a model without a tokenizer takes its token ids, and refuses its text)."""
    return group if group == "random" or is_prompt_file(group) or has_tokenizer(adapter.path) else "random"


def phase_slices(phases: list[Phase], source_of) -> list[tuple[str, int, int]]:
    """(pool, start, size) per workload phase: the phases of one pool read consecutive slices of it."""
    used: dict[str, int] = {}
    out = []
    for phase in phases:
        source = source_of(phase.group)
        out.append((source, used.get(source, 0), phase.batch))
        used[source] = used.get(source, 0) + phase.batch
    return out


def load_pools(args, adapter) -> dict[str, tuple[list[Any], str]]:
    """The prompts (and their description) of every pool the run decodes: `--prompts`' for the batch sizes
    (at least max B), and per workload phase group as many as its phases read in a row; with rotation at least
    the whole group (`rotation_size`)."""
    need = {args.source: max(args.batches)}
    for source, start, size in args.phase_slices:
        need[source] = max(need.get(source, 0), start + size)
    pools = {}
    for source, count in need.items():
        if not args.same_prompts:
            count = rotation_size(source, count)
        pools[source] = load_prompts(source, count, adapter, seed=args.seed)
    return pools


# ----------------------------------------------------------------------------------------- engines
def config_specs(grid, policies, stop_margins=()) -> dict[str, dict[str, Any]]:
    specs: dict[str, dict[str, Any]] = {
        "plain": {"kind": "plain", "k": 0, "d": 0},
        "plain-B": {"kind": "plain", "k": 0, "d": 0},
    }
    for k, d in grid:
        specs[f"{k},{d}"] = {"kind": "fixed", "k": k, "d": d}
        for margin in stop_margins:  # the same cell with per-token stopping: "K,d@margin"
            specs[f"{k},{d}@{margin:g}"] = {"kind": "fixed", "k": k, "d": d, "stop_margin": margin}
    for policy, settings in policies:
        base = adaptive_name(policy, ()) if settings else None  # the engine an A/B compares this one with
        specs[adaptive_name(policy, settings)] = {
            "kind": "adaptive", "policy": policy, "settings": dict(settings), "base": base
        }  # fmt: skip
    return specs


def build_engine(adapter, spec: dict[str, Any], max_batch: int, preset: str | None) -> LoopedSpecEngine:
    if spec["kind"] == "plain":
        return LoopedSpecEngine(adapter, speculation="off", max_batch_size=max_batch)
    if spec["kind"] == "fixed":
        plan = SpeculativeConfig(k=spec["k"], d=spec["d"], stop_margin=spec.get("stop_margin"))
        return LoopedSpecEngine(adapter, speculation=plan, max_batch_size=max_batch)
    kwargs: dict[str, Any] = {"max_batch_size": max_batch}
    if spec["policy"] is not None:
        kwargs["policy"] = spec["policy"]
    if preset is not None:
        kwargs["preset"] = preset
    if spec.get("settings"):  # tunables changed, for an A/B against the engine with the defaults
        kwargs["control"] = spec["settings"]
    return LoopedSpecEngine(adapter, speculation="adaptive", **kwargs)


def describe_adaptive(engine: LoopedSpecEngine) -> dict[str, Any]:
    ctrl = engine.controller
    config = getattr(ctrl, "config", None)
    return {
        "controller": type(ctrl).__name__,
        "policy": getattr(ctrl, "policy_name", None),
        "preset_model": getattr(config, "model", None),
        "preset_hardware": getattr(config, "hardware", None),
    }


def _label(name: str, spec: dict[str, Any]) -> str:
    if spec["kind"] != "adaptive":
        return name
    default = " (the engine's default)" if spec.get("policy") is None or name == "adaptive" else ""
    return (
        f"{name} [{spec.get('controller')}, policy {spec.get('policy')}{default}, "
        f"preset {spec.get('preset_model')}/{spec.get('preset_hardware')}]"
    )


def check_overlap(engines: dict[str, LoopedSpecEngine], specs, prompts: list[Any]) -> dict[str, Any]:
    """Refuse (exit 2) when an adaptive engine's preset was tuned on any of the evaluation prompts."""
    result: dict[str, Any] = {"checked": [], "unchecked": []}
    for name, spec in specs.items():
        if spec["kind"] != "adaptive":
            continue
        ctrl = engines[name].controller
        if not isinstance(ctrl, AdaptiveController):
            result["unchecked"].append(name)
            print(f"note: {name} runs a {type(ctrl).__name__} (no preset); prompt overlap not checked")
            continue
        result["checked" if refuse_tuning_prompts(name, ctrl.config, prompts) else "unchecked"].append(name)
    return result


def preset_depth(adapter, preset: str | None) -> int:
    """The depth the adaptive engines' preset was measured at: its file's full_depth, before the engine fitted it to
    the model's (`AdaptiveSpecConfig.for_depth`). The file is the one the engine found (`presets.lookup.preset_for`)."""
    if preset is not None:
        path, _ = preset_path(preset)
    else:
        path, _ = find_preset(adapter.name, adapter.path, {**adapter.config, "model_type": adapter.model_type})
    return read_preset_file(path).full_depth


def preset_predictions(engines, specs, depth: int, measured_depth: int) -> dict[str, Any] | None:
    """The tuner's predicted ratio to plain per bucket and cell, from the first adaptive preset's provenance.

    Reads provenance["decisions"] = {"lo..hi": {"predicted_ratio": {"K,d": ratio}, ...}} when present; None else.
    None too when the model's depth `depth` is not the one the preset was measured at (`measured_depth`): its "K,d"
    keys are cells at that depth, predicted for that model. `for_depth` moves a preset's candidates to the nearest
    relative depth, but a ratio measured at D=8 is not the ratio of the moved cell at D=4 (another cost per pass,
    another agreement), and cells of one depth may map onto one cell of the other; no prediction beats a wrong one.
    """
    for name, spec in specs.items():
        ctrl = engines[name].controller if spec["kind"] == "adaptive" else None
        provenance = getattr(getattr(ctrl, "config", None), "provenance", None)
        decisions = provenance.get("decisions") if isinstance(provenance, dict) else None
        if not isinstance(decisions, dict):
            continue
        out = {}
        for key, note in decisions.items():
            lo, sep, hi = str(key).partition("..")
            if not sep or not lo.isdigit() or not isinstance(note, dict):
                continue
            ratios = note.get("predicted_ratio")
            if isinstance(ratios, dict):
                out[key] = {"min": int(lo), "max": int(hi) if hi.isdigit() else None, "ratios": ratios}
        if out and depth != measured_depth:
            print(
                f"note: no pred column: the preset's predictions are for its cells at depth {measured_depth}, the "
                f"model runs D={depth}"
            )
            return None
        if out:
            return out
    return None


def predicted_for(predictions: dict[str, Any] | None, b: int) -> tuple[str, dict[str, float]] | None:
    for key, entry in (predictions or {}).items():
        if entry["min"] <= b and (entry["max"] is None or b <= entry["max"]):
            return key, entry["ratios"]
    return None


# ----------------------------------------------------------------------------------------- one run
def _stats(engine: LoopedSpecEngine) -> dict[str, Any]:
    s = engine.stats
    return {
        "draft": s.num_draft_tokens,
        "accepted": s.num_accepted_tokens,
        "rounds": s.num_rounds,
        "request_rounds": sum(b * n for b, n in s.batch_size_histogram.items()),
        "plans": dict(s.plan_histogram),
        "prefill": s.phase_seconds["prefill"],
        "control": s.phase_seconds["control"],
        "preemptions": s.num_preemptions,
    }


def greedy_params(count: int, max_tokens: int) -> list[SamplingParams]:
    """What every timed run decodes with: greedy, eos ignored, `max_tokens` new tokens, request i seeded i."""
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i) for i in range(count)]


def _record(s0: dict[str, Any], s1: dict[str, Any], wall: float, outputs: list) -> dict[str, Any]:
    """A timed run's record: decode time and tokens and the engine-counter deltas (`_stats` before and after)."""
    prefill = s1["prefill"] - s0["prefill"]
    decode_tokens = sum(len(o.token_ids) for o in outputs) - len(outputs)
    decode_seconds = wall - prefill
    plans = {k: v - s0["plans"].get(k, 0) for k, v in s1["plans"].items() if v - s0["plans"].get(k, 0)}
    return {
        "wall_s": wall,
        "prefill_s": prefill,
        "decode_s": decode_seconds,
        "decode_tokens": decode_tokens,
        "tokens_per_s": decode_tokens / decode_seconds if decode_seconds > 0 else float("nan"),
        "draft_tokens": s1["draft"] - s0["draft"],
        "accepted_tokens": s1["accepted"] - s0["accepted"],
        "rounds": s1["rounds"] - s0["rounds"],
        "request_rounds": s1["request_rounds"] - s0["request_rounds"],
        "control_s": s1["control"] - s0["control"],
        "preemptions": s1["preemptions"] - s0["preemptions"],
        "plans": plans,
    }


def timed_generate(engine: LoopedSpecEngine, prompts: list[Any], max_tokens: int) -> tuple[dict[str, Any], list]:
    """One `generate` of `prompts`; decode time, decode tokens and the engine-counter deltas."""
    params = greedy_params(len(prompts), max_tokens)
    s0 = _stats(engine)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    return _record(s0, _stats(engine), wall, outputs), [list(o.token_ids) for o in outputs]


def timed_slices(
    engines: dict[str, LoopedSpecEngine], prompts: list[Any], max_tokens: int, slice_s: float, rng: random.Random
) -> dict[str, tuple[dict[str, Any], list]]:
    """Every engine decodes `prompts` at once, the engines taking turns of at least `slice_s` seconds of steps
    (the order shuffled every turn); per engine the record and outputs `timed_generate` would give.

    Why (docs/benchmarking.md): this machine's speed drifts over seconds (run times of consecutive 0.3 s
    generates correlate at 0.7), so engines timed one whole `generate` after another see different machines;
    taking turns within ~20 ms they see the same one, and the A/A spread shrinks several times. Turns are
    measured in time, not steps: a step-by-step alternation made every step start after another engine's and
    charged that switch once per step, so the engine with more, shorter steps (plain decoding) paid it more
    often and speculation looked 5-10 % better than whole-`generate` timing said at B = 1.
    """
    params = greedy_params(len(prompts), max_tokens)
    before, wall, ids, done = {}, {}, {}, {}
    for name, engine in engines.items():
        before[name] = _stats(engine)
        start = time.perf_counter()
        ids[name] = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        wall[name] = time.perf_counter() - start
        done[name] = {}
    active = list(engines)
    while active:
        rng.shuffle(active)
        for name in active:
            engine, finished, want = engines[name], done[name], len(ids[name])
            start = now = time.perf_counter()
            while len(finished) < want and now - start < slice_s:
                if not engine.has_unfinished_requests():
                    raise RuntimeError(f"{name}: engine stopped with {want - len(finished)} requests unfinished")
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                now = time.perf_counter()
            wall[name] += now - start
        active = [n for n in active if len(done[n]) < len(ids[n])]
    out = {}
    for name, engine in engines.items():
        outputs = [done[name][i] for i in ids[name]]
        out[name] = (_record(before[name], _stats(engine), wall[name], outputs), [list(o.token_ids) for o in outputs])
    return out


def timed_phase(
    jobs: dict[str, LoopedSpecEngine], prompts: list[Any], args, rng: random.Random
) -> dict[str, tuple[dict[str, Any], list]]:
    """Time every engine of `jobs` on `prompts` in an order shuffled here: in turns of `--slice-ms` (`timed_slices`)
    or, with 0, one whole `generate` after another. Names sharing an engine (the workload's oracle runs a phase
    on a configuration's own engine) share its one run: an engine cannot decode two batches at once."""
    order = list(jobs)
    rng.shuffle(order)
    names_of: dict[int, list[str]] = {}
    for name in order:
        names_of.setdefault(id(jobs[name]), []).append(name)
    runs = {names[0]: jobs[names[0]] for names in names_of.values()}
    if args.slice_ms > 0:
        done = timed_slices(runs, prompts, args.max_tokens, args.slice_ms / 1000.0, rng)
    else:
        done = {name: timed_generate(engine, prompts, args.max_tokens) for name, engine in runs.items()}
    return {name: done[names[0]] for names in names_of.values() for name in names}


def check_equal(name: str, outputs: list, reference: list, where: str) -> None:
    for i, (got, want) in enumerate(zip(outputs, reference)):
        if got != want:
            j = next((t for t, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise OutputMismatch(
                f"greedy output of {name} differs from plain at {where}, request {i}: first difference at "
                f"generated token {j} ({got[j : j + 4]} vs plain {want[j : j + 4]}); speculation must not change "
                "greedy output - this is an engine bug"
            )
    if len(outputs) != len(reference):
        raise OutputMismatch(f"{name} returned {len(outputs)} outputs, plain {len(reference)}, at {where}")


# ----------------------------------------------------------------------------------------- statistics
def median_ci(values: list[float], z: float = 1.96) -> tuple[float, float]:
    """Distribution-free ~95 % confidence interval of the median: the order statistics j and k of the sorted
    values with j = floor((n - z sqrt(n)) / 2) and k = ceil(1 + (n + z sqrt(n)) / 2) (1-based, clamped to 1..n);
    with few values it is their whole range."""
    ordered = sorted(values)
    n = len(ordered)
    j = max(int((n - z * n**0.5) // 2), 1)
    k = min(-int(-(1 + (n + z * n**0.5) / 2) // 1), n)
    return ordered[j - 1], ordered[k - 1]


def spread(values: list[float]) -> dict[str, Any]:
    """Median, min, max and the median's ~95 % confidence interval (`median_ci`) of per-round values."""
    finite = [v for v in values if v == v]
    if not finite:
        nan = float("nan")
        return {"median": nan, "min": nan, "max": nan, "ci": [nan, nan], "per_round": values}
    low, high = median_ci(finite)
    return {
        "median": statistics.median(finite),
        "min": min(finite),
        "max": max(finite),
        "ci": [low, high],
        "per_round": values,
    }


def noise_floor(aa: dict[str, Any]) -> float:
    """Largest deviation of an A/A per-round ratio from 1 (plain vs plain: ideally 0)."""
    finite = [v for v in aa["per_round"] if v == v]
    return max((abs(v - 1.0) for v in finite), default=float("nan"))


def held_out(measured: list, choose, value) -> list[float]:
    """Per round r: `value(round r, choose(the other rounds))`, a choice made without round r's noise.

    The best of many noisy configurations, picked and scored on the same rounds, is biased upwards (its
    noise was part of why it won); scored on a round that did not take part in the choice, it is not.
    """
    if len(measured) < 2:
        return [float("nan")]
    return [value(rd, choose([m for j, m in enumerate(measured) if j != i])) for i, rd in enumerate(measured)]


def fmt_held_out(stat: dict[str, Any]) -> str:
    """`fmt` of a held-out ratio, or why there is none: a choice held out of one round needs another round."""
    if any(v == v for v in stat["per_round"]):
        return fmt(stat)
    return "n/a: one measured round leaves none other to choose on, --repeats >= 3 gives one"


def fmt(stat: dict[str, Any]) -> str:
    """median ±half the width of its ~95 % confidence interval [min-max]."""
    half = f" ±{(stat['ci'][1] - stat['ci'][0]) / 2:.2f}" if "ci" in stat else ""
    return f"{stat['median']:.2f}x{half} [{stat['min']:.2f}-{stat['max']:.2f}]"


def sum_plans(runs: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for run in runs:
        for key, n in run["plans"].items():
            total[key] = total.get(key, 0) + n
    return dict(sorted(total.items()))


def _progress(total: int) -> tqdm:
    return tqdm(total=total, file=sys.stderr, desc="runs", mininterval=2.0, leave=False)


def interleaved_rounds(names: list[str], repeats: int, rng: random.Random, bar, run):
    """`repeats` rounds; in each, every configuration runs once (`run(name)` -> (record, outputs)), one after
    another in an order shuffled afresh per round (bench_early_exit.py's rounds). Yields (round index, order,
    records, outputs) per round."""
    for r in range(repeats):
        order = list(names)
        rng.shuffle(order)
        records, outs = {}, {}
        for name in order:
            records[name], outs[name] = run(name)
            bar.update(1)
        yield r, order, records, outs


#: With prompt rotation, round n of a run reads the prompt pool from offset n · ROTATION_STRIDE (wrapping) ...
ROTATION_STRIDE = 7
#: ... of the whole prompt group, or of this many random token-id prompts.
ROTATION_POOL = 64


class PromptPool:
    """The prompts a run's rounds decode. Without rotation every round of a batch size decodes the pool's first B
    (a workload phase its slice); with rotation (the default) the n-th round of the whole run reads the pool from
    offset n · ROTATION_STRIDE, so rounds decode different prompts and a cell's median is over texts, not over
    repeats of one (docs/benchmarking.md "Rotating prompts": at B = 1 one 64-token text decides which (K, d) is
    best by how its drafts happen to align with it). A run has one pool per prompt group it decodes (`--prompts`
    and the workload phases' groups), all advanced together every round."""

    def __init__(self, prompts: list[Any], rotate: bool) -> None:
        self.prompts, self.rotate, self.rounds = prompts, rotate, 0

    def slice(self, start: int, size: int) -> list[Any]:
        """The round's prompts `start` .. `start + size` of the (rotated) pool."""
        offset = self.rounds * ROTATION_STRIDE if self.rotate else 0
        return [self.prompts[(offset + start + i) % len(self.prompts)] for i in range(size)]

    def next_round(self) -> None:
        self.rounds += 1


def rotation_size(kind: str, count: int) -> int:
    """Prompts to load for rotation: the whole set of `kind` (a group or a prompt file; random token ids:
    ROTATION_POOL), at least `count`."""
    if kind == "random":
        return max(count, ROTATION_POOL)
    return max(count, len(read_prompt_file(kind) if is_prompt_file(kind) else prompt_group(kind)))


def phase_rounds(names: list[str], repeats: int, rng: random.Random, bar, phases, args):
    """`repeats` rounds; in each, every configuration runs every phase once, all of a phase's runs interleaved
    (`timed_phase`: in turns of `--slice-ms`, or whole runs in an order shuffled afresh).

    `phases`: per phase (engine_of(name), pool, start, size): the phase decodes `args.pools[pool].slice(start,
    size)`, the same prompts for every configuration of a round. Yields (round index, order, records, outputs) per
    round, records[name] and outputs[name] being lists over the phases; order is the first phase's run order.
    Every pool moves on to its next round after each round.
    """
    for r in range(repeats):
        records: dict[str, list] = {name: [] for name in names}
        outs: dict[str, list] = {name: [] for name in names}
        order: list[str] = []
        for engine_of, pool, start, size in phases:
            prompts = args.pools[pool].slice(start, size)
            done = timed_phase({name: engine_of(name) for name in names}, prompts, args, rng)
            order = order or list(done)
            for name in names:
                records[name].append(done[name][0])
                outs[name].append(done[name][1])
        for pool in args.pools.values():
            pool.next_round()
        bar.update(len(names))
        yield r, order, records, outs


# ----------------------------------------------------------------------------------------- batch sizes
def bench_batch(engines, specs, prompts, b: int, args, rng: random.Random, bar) -> dict[str, Any]:
    """`repeats` interleaved rounds of every configuration at batch size b; round 0 is discarded."""
    names = list(engines)
    rounds, orders, checks = [], [], 0
    phase = [(engines.__getitem__, args.source, 0, b)]
    for r, order, runs, outs in phase_rounds(names, args.repeats, rng, bar, phase, args):
        for name in names:
            if name != "plain":
                check_equal(name, outs[name][0], outs["plain"][0], f"B={b}, round {r}")
                checks += 1
        rounds.append({name: runs[name][0] for name in names})
        orders.append(order)
    measured = rounds[1:]
    plain_tps = [rd["plain"]["tokens_per_s"] for rd in measured]
    row: dict[str, Any] = {
        "plain_tokens_per_s": statistics.median(plain_tps),
        "preemptions": sum(run["preemptions"] for rd in rounds for run in rd.values()),
        "configs": {},
        "rounds": rounds,
        "orders": orders,
        "equality_checks": checks,
    }
    for name in names:
        runs = [rd[name] for rd in measured]
        draft = sum(x["draft_tokens"] for x in runs)
        cell = {
            **specs[name],
            "ratio": spread([x["tokens_per_s"] / p for x, p in zip(runs, plain_tps)]),
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
            "best_of_ratio": max(x["tokens_per_s"] for x in runs) / max(plain_tps),
            "acceptance": sum(x["accepted_tokens"] for x in runs) / draft if draft else None,
            "tokens_per_round": sum(x["decode_tokens"] for x in runs) / max(sum(x["request_rounds"] for x in runs), 1),
            # mean share of the batch in a decode round: under speculation requests drift apart and a batch
            # that started together runs short of requests while its slowest ones finish
            "batch_fill": sum(x["request_rounds"] for x in runs) / max(b * sum(x["rounds"] for x in runs), 1),
            "plans": sum_plans(runs),
            "control_us_per_round": 1e6 * sum(x["control_s"] for x in runs) / max(sum(x["rounds"] for x in runs), 1),
        }
        row["configs"][name] = cell
    row["aa"] = row["configs"]["plain-B"]["ratio"]
    row["noise_floor"] = noise_floor(row["aa"])
    fixed = [n for n in names if specs[n]["kind"] == "fixed"]
    summary: dict[str, Any] = {"adaptive": {}}
    best = max(fixed, key=lambda n: row["configs"][n]["ratio"]["median"]) if fixed else None
    if best is not None:
        summary["best_fixed"] = best
        summary["best_fixed_ratio"] = row["configs"][best]["ratio"]
    for name in names:
        if specs[name]["kind"] != "adaptive":
            continue
        entry = {"vs_plain": row["configs"][name]["ratio"], "plans": row["configs"][name]["plans"]}
        if best is not None:
            entry["vs_best_fixed"] = spread([rd[name]["tokens_per_s"] / rd[best]["tokens_per_s"] for rd in measured])

            def pick(rounds):
                return max(
                    fixed,
                    key=lambda n: statistics.median(r[n]["tokens_per_s"] / r["plain"]["tokens_per_s"] for r in rounds),
                )

            entry["vs_best_fixed_held_out"] = spread(
                held_out(measured, pick, lambda rd, n, name=name: rd[name]["tokens_per_s"] / rd[n]["tokens_per_s"])
            )
        add_vs_base(entry, name, specs, measured, lambda rd, n: rd[n]["tokens_per_s"])
        summary["adaptive"][name] = entry
    row["summary"] = summary
    found = predicted_for(args.predictions, b)
    if found is not None:
        row["predicted_bucket"] = found[0]
        for name, cell in row["configs"].items():
            if cell["kind"] == "fixed" and name in found[1]:
                cell["predicted_ratio"] = found[1][name]
    if args.confirm_repeats and fixed:
        top = sorted(fixed, key=lambda n: -row["configs"][n]["ratio"]["median"])[: args.confirm_top]
        row["confirm"] = confirm_batch(engines, specs, prompts, b, top, args, rng, bar)
    # what each adaptive engine's policy believes after this batch size (per bucket: predictions, factors)
    row["controller_state"] = {
        name: engines[name].controller.stats().get("buckets") for name in names if specs[name]["kind"] == "adaptive"
    }
    return row


def confirm_batch(engines, specs, prompts, b: int, top: list[str], args, rng: random.Random, bar) -> dict[str, Any]:
    """The confirmation stage: `--confirm-repeats` more interleaved rounds of plain, plain-B, the screen's
    `top` fixed cells and the adaptive engines only (all measured: every engine is warm by now).

    The screen's best cell is the best of many noisy medians, which flatters it; in these rounds the choice
    is already made, so its ratio is not (and fewer configurations per round give more rounds per minute).
    "Best fixed" here is the screen's best; adaptive is also compared with the best of the `top` cells chosen
    on the other confirmation rounds (held out).
    """
    names = ["plain", "plain-B", *top, *(n for n in engines if specs[n]["kind"] == "adaptive")]
    measured, checks = [], 0
    phase = [(engines.__getitem__, args.source, 0, b)]
    for r, _order, runs, outs in phase_rounds(names, args.confirm_repeats, rng, bar, phase, args):
        for name in names[1:]:
            check_equal(name, outs[name][0], outs["plain"][0], f"B={b}, confirmation round {r}")
            checks += 1
        measured.append({name: runs[name][0] for name in names})

    def tps(rd, name):
        return rd[name]["tokens_per_s"]

    out: dict[str, Any] = {
        "configs": names,
        "ratio": {n: spread([tps(rd, n) / tps(rd, "plain") for rd in measured]) for n in names[1:]},
        "rounds": measured,
        "equality_checks": checks,
        "best_fixed": top[0],
        "adaptive": {},
    }
    out["aa"] = out["ratio"]["plain-B"]

    def pick(rounds):
        return max(top, key=lambda n: statistics.median(tps(r, n) / tps(r, "plain") for r in rounds))

    for name in names[2 + len(top) :]:
        out["adaptive"][name] = {
            "vs_plain": out["ratio"][name],
            "vs_best_fixed": spread([tps(rd, name) / tps(rd, top[0]) for rd in measured]),
            "vs_best_fixed_held_out": spread(held_out(measured, pick, lambda rd, n, a=name: tps(rd, a) / tps(rd, n))),
            "plans": sum_plans([rd[name] for rd in measured]),
        }
        add_vs_base(out["adaptive"][name], name, specs, measured, tps)
    return out


def add_vs_base(entry: dict[str, Any], name: str, specs, measured: list, tps) -> None:
    """An adaptive engine with policy switches off: its per-round ratio to the same policy with them on (the A/B)."""
    base = specs[name].get("base")
    if base in specs:
        entry["vs_base"] = {"base": base, **spread([tps(rd, name) / tps(rd, base) for rd in measured])}


def fmt_vs_base(entry: dict[str, Any]) -> str:
    return f", vs {entry['vs_base']['base']} {fmt(entry['vs_base'])}" if "vs_base" in entry else ""


def print_batch(b: int, row: dict[str, Any], specs) -> None:
    print(f"\nB={b}: plain {row['plain_tokens_per_s']:.1f} decode tok/s (median)")
    print(f"A/A (plain-B vs plain): {fmt(row['aa'])}  noise floor +-{100 * noise_floor(row['aa']):.0f}%")
    if "predicted_bucket" in row:
        print(f"  pred = the preset tuner's predicted ratio for bucket {row['predicted_bucket']}")
    print("  fill = mean share of the batch's requests still decoding in a round (1.00: all, every round)")
    if row["preemptions"]:
        print(f"  warning: {row['preemptions']} KV-cache preemptions; times include recomputation")
    with_pred = "predicted_bucket" in row  # without the preset's predictions for this model, no column of dashes
    pred_head = f" {'pred':>6}" if with_pred else ""
    print(
        f"  {'config':<18} {'ratio [min-max]':>20} {'best-of':>7}{pred_head} {'accept':>7} {'tok/round':>9} "
        f"{'fill':>5} {'ctrl us':>8}  plans"
    )
    for name, cell in row["configs"].items():
        if name in ("plain", "plain-B"):
            continue
        acc = "-" if cell["acceptance"] is None else f"{cell['acceptance']:.2f}"
        plans = cell["plans"] if specs[name]["kind"] == "adaptive" else ""
        pred = f"{cell['predicted_ratio']:.2f}x" if "predicted_ratio" in cell else "-"
        pred = f" {pred:>6}" if with_pred else ""
        print(
            f"  {name:<18} {fmt(cell['ratio']):>20} {cell['best_of_ratio']:>6.2f}x{pred} {acc:>7} "
            f"{cell['tokens_per_round']:>9.2f} {cell['batch_fill']:>5.2f} {cell['control_us_per_round']:>8.0f}  {plans}"
        )
    s = row["summary"]
    if "best_fixed" in s:
        print(f"  best fixed: {s['best_fixed']} {fmt(s['best_fixed_ratio'])}")
    for name, entry in s["adaptive"].items():
        line = f"  {name}: vs plain {fmt(entry['vs_plain'])}"
        if "vs_best_fixed" in entry:
            line += f", vs best fixed {fmt(entry['vs_best_fixed'])}"
            line += f" (held-out choice {fmt_held_out(entry['vs_best_fixed_held_out'])})"
        print(line + fmt_vs_base(entry) + f"; plans {entry['plans']}")
    if "confirm" in row:
        print_confirm(row["confirm"])


def print_confirm(c: dict[str, Any]) -> None:
    rounds = len(c["rounds"])
    print(f"  confirmation ({rounds} more rounds of plain, plain-B, the screen's top fixed cells, adaptive):")
    print(f"    A/A {fmt(c['aa'])}; " + "; ".join(f"{n} {fmt(c['ratio'][n])}" for n in c["configs"][2:]))
    for name, entry in c["adaptive"].items():
        print(
            f"    {name}: vs plain {fmt(entry['vs_plain'])}, vs the screen's best fixed ({c['best_fixed']}) "
            f"{fmt(entry['vs_best_fixed'])}, vs the best of the top cells chosen on the other rounds "
            f"{fmt(entry['vs_best_fixed_held_out'])}{fmt_vs_base(entry)}; plans {entry['plans']}"
        )


# ----------------------------------------------------------------------------------------- workload
def bench_workload(engines, specs, prompts, phases, args, rng: random.Random, bar) -> dict[str, Any]:
    """Every configuration runs the phases back to back; interleaved, repeated, round 0 discarded."""
    names = list(engines)
    rounds, orders, checks = [], [], 0
    steps = [(engines.__getitem__, *where) for where in args.phase_slices]
    for r, order, runs, outs in phase_rounds(names, args.repeats, rng, bar, steps, args):
        for name in names:
            if name != "plain":
                for p, (got, want) in enumerate(zip(outs[name], outs["plain"])):
                    check_equal(name, got, want, f"workload round {r}, phase {p} ({phase_label(phases[p])})")
                    checks += 1
        rounds.append(runs)
        orders.append(order)
    measured = rounds[1:]

    def total_time(rd, name):
        return sum(run["decode_s"] for run in rd[name])

    def total_tps(rd, name):
        return sum(run["decode_tokens"] for run in rd[name]) / total_time(rd, name)

    out: dict[str, Any] = {
        "phases": [phase.batch for phase in phases],
        "phase_groups": [phase.group for phase in phases],  # the group each phase asked for
        "phase_prompts": [pool for pool, _, _ in args.phase_slices],  # what it decoded: the group, or "random"
        "rounds": rounds,
        "orders": orders,
        "equality_checks": checks,
    }
    out["configs"] = {
        name: {
            **specs[name],
            "tokens_per_s": statistics.median(total_tps(rd, name) for rd in measured),
            "ratio": spread([total_tps(rd, name) / total_tps(rd, "plain") for rd in measured]),
            "best_of_ratio": max(total_tps(rd, name) for rd in measured)
            / max(total_tps(rd, "plain") for rd in measured),
            "plans": sum_plans([run for rd in measured for run in rd[name]]),
        }
        for name in names
    }
    out["aa"] = out["configs"]["plain-B"]["ratio"]
    out["noise_floor"] = noise_floor(out["aa"])
    candidates = ["plain"] + [n for n in names if specs[n]["kind"] == "fixed"]
    oracle = []
    for p in range(len(phases)):
        best = min(candidates, key=lambda n: statistics.median(rd[n][p]["decode_s"] for rd in measured))
        oracle.append(best)
    out["oracle_phases"] = oracle
    oracle_times = [sum(rd[n][p]["decode_s"] for p, n in enumerate(oracle)) for rd in measured]

    def pick_phases(rounds):
        return [
            min(candidates, key=lambda n: statistics.median(r[n][p]["decode_s"] for r in rounds))
            for p in range(len(phases))
        ]

    held_oracle_times = held_out(
        measured, pick_phases, lambda rd, ns: sum(rd[n][p]["decode_s"] for p, n in enumerate(ns))
    )
    out["oracle_ratio"] = spread([total_time(rd, "plain") / t for rd, t in zip(measured, oracle_times)])
    fixed = [n for n in names if specs[n]["kind"] == "fixed"]
    best_single = max(fixed, key=lambda n: out["configs"][n]["ratio"]["median"]) if fixed else None
    out["best_single_fixed"] = best_single
    out["adaptive"] = {}
    for name in names:
        if specs[name]["kind"] != "adaptive":
            continue
        entry = {
            # same tokens in every config (outputs are checked equal), so a time ratio is a tokens/s ratio
            "vs_oracle": spread([t / total_time(rd, name) for rd, t in zip(measured, oracle_times)]),
            "vs_oracle_held_out": spread([t / total_time(rd, name) for rd, t in zip(measured, held_oracle_times)]),
            "vs_plain": out["configs"][name]["ratio"],
            "plans": out["configs"][name]["plans"],
        }
        if best_single is not None:
            entry["vs_best_single_fixed"] = spread(
                [total_time(rd, best_single) / total_time(rd, name) for rd in measured]
            )
        out["adaptive"][name] = entry
    if args.confirm_repeats:
        out["confirm"] = confirm_workload(engines, specs, prompts, phases, oracle, best_single, args, rng, bar)
    return out


def confirm_workload(engines, specs, prompts, phases, oracle, best_single, args, rng, bar) -> dict[str, Any]:
    """The workload's confirmation stage: `--confirm-repeats` more interleaved rounds of plain, plain-B, the
    screen's best single fixed cell, the screen's per-phase oracle (phase p on the engine the screen chose for
    it) and the adaptive engines. Like the per-batch-size stage, the choices are the screen's, so neither the
    oracle nor the best single cell is flattered by the noise that chose it."""
    adaptive = [n for n in engines if specs[n]["kind"] == "adaptive"]
    names = ["plain", "plain-B", *([best_single] if best_single else []), "oracle", *adaptive]
    measured, checks = [], 0

    def phase(p: int):  # the oracle runs phase p on the engine the screen chose for it
        return lambda name: engines[oracle[p] if name == "oracle" else name]

    steps = [(phase(p), *where) for p, where in enumerate(args.phase_slices)]
    for r, _order, runs, outs in phase_rounds(names, args.confirm_repeats, rng, bar, steps, args):
        for name in names[1:]:
            for p, (got, want) in enumerate(zip(outs[name], outs["plain"])):
                check_equal(name, got, want, f"workload confirmation round {r}, phase {p} ({phase_label(phases[p])})")
                checks += 1
        measured.append(runs)

    def total_time(rd, name):
        return sum(run["decode_s"] for run in rd[name])

    out: dict[str, Any] = {"configs": names, "oracle_phases": list(oracle), "rounds": measured}
    out["equality_checks"] = checks
    # same tokens in every config (outputs are checked equal), so a time ratio is a tokens/s ratio
    out["ratio"] = {n: spread([total_time(rd, "plain") / total_time(rd, n) for rd in measured]) for n in names[1:]}
    out["aa"] = out["ratio"]["plain-B"]
    out["best_single_fixed"] = best_single
    out["adaptive"] = {}
    for name in adaptive:
        entry = {
            "vs_plain": out["ratio"][name],
            "vs_oracle": spread([total_time(rd, "oracle") / total_time(rd, name) for rd in measured]),
            "plans": sum_plans([run for rd in measured for run in rd[name]]),
        }
        if best_single:
            entry["vs_best_single_fixed"] = spread(
                [total_time(rd, best_single) / total_time(rd, name) for rd in measured]
            )
        out["adaptive"][name] = entry
    return out


def phase_label(phase: Phase) -> str:
    return f"B={phase.batch}, {phase.group}"


def workload_labels(wl: dict[str, Any]) -> list[str]:
    """Per phase "B:GROUP" (GROUP the group it asked for, "->random" added when it decoded random token ids)."""
    groups = wl.get("phase_groups") or [None] * len(wl["phases"])
    decoded = wl.get("phase_prompts") or groups
    return [
        str(b) if g is None else f"{b}:{g}" + ("" if d == g else f"->{d}")
        for b, g, d in zip(wl["phases"], groups, decoded)
    ]


def print_workload(wl: dict[str, Any]) -> None:
    labels = workload_labels(wl)
    print(f"\nchanging workload {' -> '.join(labels)} (total decode tokens/s as a ratio to plain, per round):")
    print(f"A/A (plain-B vs plain): {fmt(wl['aa'])}  noise floor +-{100 * noise_floor(wl['aa']):.0f}%")
    for name, cell in wl["configs"].items():
        if name not in ("plain", "plain-B"):
            print(f"  {name:<18} {fmt(cell['ratio']):>20}  best-of {cell['best_of_ratio']:.2f}x")
    print(f"  per-phase oracle: {'; '.join(f'{label} {n}' for label, n in zip(labels, wl['oracle_phases']))}")
    print(f"  oracle vs plain {fmt(wl['oracle_ratio'])}; best single fixed: {wl['best_single_fixed']}")
    for name, entry in wl["adaptive"].items():
        line = f"  {name}: vs oracle {fmt(entry['vs_oracle'])}"
        line += f" (held-out choice {fmt_held_out(entry['vs_oracle_held_out'])})"
        if "vs_best_single_fixed" in entry:
            line += f", vs best single fixed {fmt(entry['vs_best_single_fixed'])}"
        print(line + f", vs plain {fmt(entry['vs_plain'])}; plans {entry['plans']}")
    c = wl.get("confirm")
    if c is not None:
        print(
            f"  confirmation ({len(c['rounds'])} more rounds of plain, plain-B, the best single fixed, the oracle, "
            "adaptive):"
        )
        print(f"    A/A {fmt(c['aa'])}; " + "; ".join(f"{n} {fmt(c['ratio'][n])}" for n in c["configs"][2:]))
        for name, entry in c["adaptive"].items():
            line = f"    {name}: vs oracle {fmt(entry['vs_oracle'])}"
            if "vs_best_single_fixed" in entry:
                line += f", vs best single fixed {fmt(entry['vs_best_single_fixed'])}"
            print(line + f", vs plain {fmt(entry['vs_plain'])}; plans {entry['plans']}")


def print_summary(results: dict[str, Any], workload: dict[str, Any] | None) -> None:
    """One line per batch size (and the workload): the numbers issue 10's acceptance criteria are about."""
    print("\nsummary (median [min-max] of per-round ratios):")
    for b, row in results.items():
        s = row["summary"]
        parts = [f"B={b}: A/A {fmt(row['aa'])}"]
        if "best_fixed" in s:
            parts.append(f"best fixed {s['best_fixed']} {fmt(s['best_fixed_ratio'])}")
        for name, entry in s["adaptive"].items():
            text = f"{name} {fmt(entry['vs_plain'])} of plain"
            if "vs_best_fixed" in entry:
                text += f", {fmt(entry['vs_best_fixed'])} of best fixed"
                text += f" (held-out {fmt_held_out(entry['vs_best_fixed_held_out'])})"
            parts.append(text)
        print("  " + "; ".join(parts))
        c = row.get("confirm")
        if c is not None:
            parts = [f"  confirmed ({len(c['rounds'])} rounds): A/A {fmt(c['aa'])}"]
            parts.append(f"{c['best_fixed']} {fmt(c['ratio'][c['best_fixed']])}")
            for name, entry in c["adaptive"].items():
                text = f"{name} {fmt(entry['vs_plain'])} of plain, {fmt(entry['vs_best_fixed'])} of best fixed"
                parts.append(text + f" ({fmt(entry['vs_best_fixed_held_out'])} held-out)")
            print("  " + "; ".join(parts))
    if workload is not None:
        print("  " + workload_summary("workload: ", workload))
        c = workload.get("confirm")
        if c is not None:
            print("  " + workload_summary(f"  confirmed ({len(c['rounds'])} rounds): ", c))


def workload_summary(head: str, wl: dict[str, Any]) -> str:
    """One summary line of the workload's screen or confirmation stage (the latter has no held-out choice)."""
    parts = [f"{head}A/A {fmt(wl['aa'])}"]
    for name, entry in wl["adaptive"].items():
        text = f"{name} {fmt(entry['vs_oracle'])} of oracle"
        if "vs_oracle_held_out" in entry:
            text += f" (held-out {fmt_held_out(entry['vs_oracle_held_out'])})"
        if "vs_best_single_fixed" in entry:
            text += f", {fmt(entry['vs_best_single_fixed'])} of best single fixed"
        parts.append(text + f", {fmt(entry['vs_plain'])} of plain")
    return "; ".join(parts)


# ----------------------------------------------------------------------------------------- main
def check_rounds(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--repeats >= 2 (the first round is discarded) and --max-tokens >= 2 (the first token is prefill's)."""
    if args.repeats < 2:
        parser.error("--repeats must be >= 2 (the first round is a discarded warm-up)")
    if args.max_tokens < 2:
        parser.error("--max-tokens must be >= 2 (the first token comes from prefill)")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--model",
        default=str(ROOT / "tests" / "fixtures" / "ouro-tiny"),
        help="checkpoint folder or shipped name (default: the repository's tests/fixtures/ouro-tiny)",
    )
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes (run in increasing order)")
    parser.add_argument(
        "--grid",
        default="auto",
        help="auto (K 1..5 x d 1..D-1; d in 1,2,D/4,D/2,D-1 for D > 5: the tuner's grid), full (K 1..8 x every d), "
        '"K,d;K,d" or none (looped_spec.tuning.grid)',
    )
    parser.add_argument("--max-tokens", type=int, default=64, help="new tokens per request (default 64)")
    parser.add_argument(
        "--prompts",
        default="eval",
        type=prompt_source_flag,
        help="prompt group (looped_spec.tuning.prompt_sets): eval (default), code, prose, tune, builtin, humaneval, "
        "random (token ids), or a prompt file of your own: .txt (a prompt a line) or .jsonl (a 'prompt' a line)",
    )
    parser.add_argument("--repeats", type=int, default=5, help="rounds per batch size; the first is discarded")
    parser.add_argument(
        "--confirm-repeats",
        type=int,
        default=0,
        help="then this many rounds of plain, plain-B, the top fixed cells and adaptive only (0: no confirmation)",
    )
    parser.add_argument("--confirm-top", type=int, default=3, help="fixed cells the confirmation re-runs (default 3)")
    parser.add_argument(
        "--policies",
        default="default",
        help="adaptive policies: comma list of default (the engine's default), ema, goodput; none (alone) = no "
        "adaptive. NAME:FIELD=VALUE adds that policy with a tunable changed (ControlSettings; several joined by +, "
        "none = None; an A/B: its rows show the ratio to the policy with the defaults), "
        "e.g. default,default:readout_budget=0.01",
    )
    parser.add_argument("--stop-margins", default="", metavar="M[,M...]",
                        help="also run each grid cell with per-token stopping at draft margin M ('K,d@M')")  # fmt: skip
    parser.add_argument("--preset", default=None, help="preset file for the adaptive engines (default: the model's)")
    parser.add_argument("--workload", action="store_true", help="also run the changing workload (--workload-phases)")
    parser.add_argument(
        "--workload-phases",
        default="1,8,32,8,1",
        help="the workload's phases: B or B:GROUP each, e.g. 8:eval,8:code,32:prose,8:eval (no GROUP: --prompts); "
        "a GROUP may be a prompt file (as --prompts)",
    )
    parser.add_argument(
        "--slice-ms",
        type=float,
        default=20.0,
        help="a round's runs take turns of at least this many ms of decode steps (default 20); 0: each run is one "
        "whole generate, one after another (the spread is several times wider on a machine whose speed drifts)",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--adapter-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--seed", type=int, default=0, help="seeds the run order and the random prompts")
    parser.add_argument(
        "--same-prompts",
        action="store_true",
        help="every round of a batch size decodes the same first B prompts (before 2026-12-02 the only way); "
        f"default: rounds rotate through the prompt set, round n reading it from offset {ROTATION_STRIDE}n",
    )
    parser.add_argument(
        "--out",
        default=None,
        help="write OUT.json (everything) and OUT.png (heatmap); an OUT ending in .json is that file, the heatmap "
        "beside it with .png",
    )
    args = parser.parse_args(argv)
    check_rounds(parser, args)
    if args.confirm_repeats < 0 or args.confirm_repeats == 1:
        parser.error("--confirm-repeats must be 0 (none) or >= 2 (the held-out choice needs another round)")
    if args.confirm_top < 1:
        parser.error("--confirm-top must be >= 1")
    if not args.slice_ms >= 0.0:
        parser.error("--slice-ms must be >= 0 (0: whole generates one after another)")
    if args.threads < 0:  # torch.set_num_threads would refuse it with a traceback
        parser.error("--threads must be >= 0 (0: torch's default)")
    try:
        args.batches = parse_batch_sizes(args.batch_sizes)
        args.phase_list = parse_phases(args.workload_phases, args.prompts) if args.workload else []
        args.phases = [phase.batch for phase in args.phase_list]
        args.phase_groups = [phase.group for phase in args.phase_list]
        args.policy_list = parse_policies(args.policies)
        args.options = parse_adapter_options(args.adapter_option)
        args.stop_margin_list = parse_stop_margins(args.stop_margins)
        # what would otherwise fail only once the model is loaded, or the rounds are timed
        check_model(args.model)
        check_preset(args.preset)
        check_prompt_source(args.prompts)
        for phase in args.phase_list:
            check_prompt_source(phase.group, f"--workload-phases entry '{phase.batch}:{phase.group}'")
        if args.out:
            for path in output_paths(Path(args.out)):
                check_out_path(path)
    except ValueError as exc:
        parser.error(str(exc))
    args.parser = parser
    return args


def parse_stop_margins(text: str) -> list[float]:
    """``"0.5,0.8"`` -> the margins, each in (0, 1]; a ValueError naming --stop-margins and the entry."""
    margins = []
    for entry in (m.strip() for m in text.split(",") if m.strip()):
        try:
            margin = float(entry)
        except ValueError:
            raise ValueError(f"--stop-margins entry {entry!r}: expected a number in (0, 1], e.g. 0.5") from None
        if not 0.0 < margin <= 1.0:
            raise ValueError(f"--stop-margins entry {entry!r}: each margin must be in (0, 1]")
        margins.append(margin)
    return margins


def output_paths(out: Path) -> tuple[Path, Path]:
    """The result file and the heatmap `--out OUT` writes: OUT.json and OUT.png, or OUT itself when it ends in .json
    (and the heatmap beside it, .png for .json): `--out res.json` should not write res.json.json."""
    if out.suffix == ".json":
        return out, out.with_suffix(".png")
    return out.with_name(out.name + ".json"), out.with_name(out.name + ".png")


def command_line(argv: list[str] | None, script: str) -> tuple[str, datetime]:
    """Print (and return) the command being run, as a shell line, and the time it started."""
    command = shlex.join([sys.executable, *sys.argv] if argv is None else [script, *argv])
    now = datetime.now(timezone.utc)
    print(f"$ {command}")
    print(f"# {now:%Y-%m-%d %H:%M:%S} UTC")
    return command, now


def run_record(command: str, now: datetime, adapter) -> dict[str, Any]:
    """The head of a result file: the command, when, the model and the machine."""
    return {
        "command": command,
        "date": now.isoformat(timespec="seconds"),
        "model": adapter.name,
        "model_type": adapter.model_type,
        "depth": adapter.full_depth,
        "machine": {"torch": torch.__version__, "threads": torch.get_num_threads(), "device": str(adapter.device)},
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    command, now = command_line(argv, "bench_speculative.py")
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_model(args.parser, args.model, dtype=args.dtype, device=args.device, **args.options)
    depth = adapter.full_depth
    try:
        grid = parse_grid(args.grid, depth, allow_none=True)
    except ValueError as exc:
        args.parser.error(str(exc))
    phases = args.phase_list
    max_batch = max(args.batches + args.phases)
    args.source = prompt_source(args.prompts, adapter)
    args.phase_slices = phase_slices(phases, lambda group: prompt_source(group, adapter))
    replaced = sorted({g for g in [args.prompts, *args.phase_groups] if prompt_source(g, adapter) != g})
    if replaced:
        print(f"note: {adapter.name} has no tokenizer; prompt group(s) {', '.join(replaced)} replaced by random "
              "token-id prompts (one pool)")  # fmt: skip
    try:
        loaded = load_pools(args, adapter)
    except PromptSetError as exc:
        args.parser.error(str(exc))
    args.pools = {source: PromptPool(p, rotate=not args.same_prompts) for source, (p, _) in loaded.items()}
    args.pool = args.pools[args.source]  # --prompts' pool (the batch sizes')
    prompts, prompt_desc = loaded[args.source]
    rotating = f"; rounds rotate through them (round n from offset {ROTATION_STRIDE}n)" if args.pool.rotate else ""
    prompt_desc += rotating
    others = [f"{source}: {desc}" for source, (_, desc) in loaded.items() if source != args.source]
    if others:
        prompt_desc += "; workload phases also: " + "; ".join(others)
    every_prompt = [p for pool, _ in loaded.values() for p in pool]  # all the run decodes, every phase's too
    specs = config_specs(grid, args.policy_list, args.stop_margin_list)
    print(
        f"model {adapter.name} ({adapter.model_type}) D={depth}, {args.dtype} on {args.device}, "
        f"{torch.get_num_threads()} threads; prompts: {prompt_desc}; {args.max_tokens} new tokens per request "
        f"(greedy, eos ignored); {args.repeats} rounds per batch size, the first discarded"
    )
    print("ratios: median over the measured rounds of (config tok/s / plain tok/s in the same round)")
    if args.slice_ms > 0:
        print(f"interleave: a round's runs decode at once, taking turns of >= {args.slice_ms:g} ms of steps")
    else:
        print("interleave: a round's runs are whole generates, one after another in a shuffled order")
    print(f"spread: {SPREAD}; {BEST_OF}")
    try:
        engines = {name: build_engine(adapter, spec, max_batch, args.preset) for name, spec in specs.items()}
    except ValueError as exc:  # the engine names its fields (preset='...'); the command line has flags for them
        args.parser.error(name_flags(str(exc), flags_of(args.parser)))
    for name, spec in specs.items():
        if spec["kind"] == "adaptive":
            spec.update(describe_adaptive(engines[name]))
    print("configs: " + ", ".join(_label(name, spec) for name, spec in specs.items()))
    overlap = check_overlap(engines, specs, every_prompt)
    adaptive_specs = any(spec["kind"] == "adaptive" for spec in specs.values())
    measured_depth = preset_depth(adapter, args.preset) if adaptive_specs else depth
    args.predictions = preset_predictions(engines, specs, depth, measured_depth)
    warm = [prompts[i % len(prompts)] for i in range(max_batch)]
    for engine in engines.values():  # warm up at the full batch shape
        engine.generate(warm, SamplingParams(max_tokens=4, ignore_eos=True))
    rng = random.Random(args.seed)
    adaptive = len(engines) - 2 - len(grid)
    confirm_runs = args.confirm_repeats * (2 + min(args.confirm_top, len(grid)) + adaptive) if grid else 0
    screen_runs = args.repeats * len(engines) * (len(args.batches) + (1 if phases else 0))
    workload_confirm = args.confirm_repeats * (3 + (1 if grid else 0) + adaptive) if phases else 0
    bar = _progress(screen_runs + confirm_runs * len(args.batches) + workload_confirm)
    results: dict[str, Any] = {}
    try:
        for b in args.batches:
            results[str(b)] = bench_batch(engines, specs, prompts, b, args, rng, bar)
            bar.clear()
            print_batch(b, results[str(b)], specs)
        workload = bench_workload(engines, specs, prompts, phases, args, rng, bar) if phases else None
    finally:
        bar.close()
        for engine in engines.values():
            engine.close()
    if workload is not None:
        print_workload(workload)
    print_summary(results, workload)
    checks = sum(r["equality_checks"] + r.get("confirm", {}).get("equality_checks", 0) for r in results.values())
    checks += workload["equality_checks"] + workload.get("confirm", {}).get("equality_checks", 0) if workload else 0
    print(f"\ngreedy outputs equal to plain's: {checks} of {checks} checks")
    report = {
        **run_record(command, now, adapter),
        "args": {k: v for k, v in vars(args).items() if k not in ("parser", "predictions", "pools", "phase_list")},
        "preset_predictions": args.predictions,
        "prompts": {
            "kind": args.prompts,
            "description": prompt_desc,
            "fingerprints": prompt_fingerprints(prompts),
            # every pool the run decoded (--prompts' and the workload phases' groups), each checked for overlap
            "groups": {
                source: {"description": desc, "count": len(pool), "fingerprints": prompt_fingerprints(pool)}
                for source, (pool, desc) in loaded.items()
            },
        },
        "configs": specs,
        "overlap_check": overlap,
        "spread": SPREAD,
        "best_of": BEST_OF,
        "batch_sizes": results,
        "workload": workload,
        "equality_checks": checks,
    }
    if args.out:
        write_outputs(report, Path(args.out), adapter.name, args.prompts)
    return report


def write_outputs(report: dict[str, Any], out: Path, model: str, prompts: str) -> None:
    json_path, png = output_paths(out)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1, default=str))
    print(f"wrote {json_path}")
    try:
        from looped_spec.tuning.report import write_heatmap
    except ImportError:
        print("heatmap skipped: looped_spec.tuning.report.write_heatmap is not available")
        return
    cells = {}
    for b, row in report["batch_sizes"].items():
        grid = {
            name: {"ratio": c["ratio"]["median"], "acceptance": c["acceptance"] or 0.0}
            for name, c in row["configs"].items()
            if c["kind"] == "fixed" and "@" not in name  # the (K, d) heatmap: cells without per-token stopping
        }
        if grid:
            cells[int(b)] = grid
    if not cells:
        return
    try:
        skipped = write_heatmap(cells, png, title=f"{model}: {prompts} prompts, median ratio to plain")
    except Exception as exc:  # the heatmap is a convenience (matplotlib is optional); never lose the JSON over it
        skipped = f"heatmap skipped: {type(exc).__name__}: {exc}"
    print(skipped or f"wrote {png}")


if __name__ == "__main__":
    main()
