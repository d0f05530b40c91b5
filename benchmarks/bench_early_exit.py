"""Early exit: full depth vs a tau sweep in both modes vs early exit + adaptive speculation, with its cost.

One persistent engine per configuration, all on one loaded model: `plain` (full depth, no speculation),
`plain-B` (a second plain engine: the A/A control), `adaptive` (full depth + adaptive speculation), then for
mode in skip, select: every threshold tau in `--taus` and every fixed depth k in `--exit-at-steps`, each
without speculation and, for the modes in `--spec-modes` (default skip), also with adaptive speculation
("+ spec": the target is the same early-exit model, so its greedy output must equal the twin's). For each
batch size B the benchmark runs `--repeats` rounds; in each round every configuration decodes the same B
prompts once (greedy, `--max-tokens` new tokens each, eos ignored), in an order shuffled per round. The first
round is a warm-up and is discarded. Ratios are taken within a round: (config decode tokens/s) / (plain
decode tokens/s of the same round); the table shows their median over the measured rounds and their spread,
[min-max] of those per-round ratios; the A/A line (plain-B vs plain) is the noise floor. Decode time = wall
time of `generate` minus its prefill time; decode tokens = generated tokens - B. The greedy outputs of the
full-depth configurations (plain-B, adaptive) are checked token for token against plain's of the same round,
and those of every "+ spec" configuration against its early-exit twin's.

Speed is never shown without quality: for each configuration, besides the ratio to plain, it prints the
mean loops run per token (over the measured rounds; select mode runs all D) and the mean readout depth, the
agreement of the committed tokens with full-depth greedy (position by position, and the matching prefix) and
the per-token NLL of the committed tokens under the full-depth model (dense forward), on the last round's
outputs of the evaluation prompts (held out from training and tuning; random token ids for a checkpoint
without a tokenizer).

Thresholds are in the family rule's units (Ouro: cumulative exit probability; Huginn: KL between successive
steps, 5e-4 in its paper, or the latent change with --adapter-option exit_criterion=latent); a family without
an exit signal (Nanbeige) runs the fixed depths only.

`--quality-only` measures no speed: one deterministic pass per configuration and batch size (greedy, CPU), no
A/A control, no adaptive engine, no warm-up, no rounds; the table keeps loops/token, readout depth, agreement,
matching prefix and NLL. It is what compares two exit gates (docs/tiny-models.md, "Ouro exit gate").

`--out FILE` writes FILE.json: the command, the rows, and per batch size the A/A spread and every round's runs
and order (with --quality-only: each configuration's exit counters). As in bench_speculative.py, the benchmark
exits with status 2 when the adaptive engine's preset records any of the evaluation prompts among its tuning
prompts.

The early-exit table of docs/benchmarking.md (and another family):

    python benchmarks/bench_early_exit.py --model tiny-ouro --batch-sizes 1,8 --max-tokens 32 \
        --taus 0.5,0.7,0.9 --exit-at-steps 2,3 --repeats 4 --out benchmarks/results/early-exit-tiny-ouro
    python benchmarks/bench_early_exit.py --model tiny-huginn --taus 5e-4,1e-2 --exit-at-steps 4

Quality only (deterministic; the gate comparison of docs/tiny-models.md):

    python benchmarks/bench_early_exit.py --model tiny-ouro --quality-only --batch-sizes 64 --max-tokens 32 \
        --taus 0.3,0.5,0.7,0.9,0.95,0.99 --exit-at-steps 1,2,3
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from bench_speculative import (
    SPREAD,
    _progress,
    check_equal,
    check_overlap,
    check_rounds,
    command_line,
    fmt,
    interleaved_rounds,
    noise_floor,
    run_record,
    spread,
)
from common import Bench

from looped_spec import SamplingParams
from looped_spec.tuning.grid import parse_batch_sizes, parse_int_list, prompt_source_flag
from looped_spec.tuning.inputs import parse_adapter_options
from looped_spec.tuning.prompt_sets import PromptSetError, load_prompts, prompt_fingerprints

FULL_DEPTH_GREEDY = ("plain-B", "adaptive")  # must reproduce plain's output exactly
LABELS = {"plain": "full depth (plain)", "plain-B": "plain-B (A/A control)", "adaptive": "full depth + adaptive spec"}


# ----------------------------------------------------------------------------------------- configurations
def config_specs(
    depth_rules: list[tuple[str, float | int]], spec_modes=("skip",), quality_only: bool = False
) -> dict[str, dict[str, Any]]:
    """name -> {kind, mode, rule, value[, speculation]}; the early-exit configurations in mode, then rule, order.
    Quality only: no A/A control, no adaptive engine and no "+ spec" twins (they are there for the timing; a
    twin's greedy output is its early-exit configuration's)."""
    specs: dict[str, dict[str, Any]] = {"plain": {"kind": "plain"}}
    if not quality_only:
        specs |= {"plain-B": {"kind": "plain"}, "adaptive": {"kind": "adaptive"}}
    for mode in ("skip", "select"):
        for rule, value in depth_rules:
            base = {"kind": "early-exit", "mode": mode, "rule": rule, "value": value}
            specs[f"{mode} {rule}={value}"] = base
            if mode in spec_modes and not quality_only:
                specs[f"{mode} {rule}={value} + spec"] = {**base, "speculation": "adaptive"}
    return specs


def twin(name: str) -> str | None:
    """The early-exit configuration without speculation whose greedy output `name` must reproduce."""
    return name.removesuffix(" + spec") if name.endswith(" + spec") else None


def build(bench: Bench, spec: dict[str, Any], greedy: SamplingParams, max_batch: int):
    """(engine, sampling params) of one configuration."""
    if spec["kind"] == "early-exit":
        field = "exit_threshold" if spec["rule"] == "tau" else "exit_at_step"
        speculation = spec.get("speculation", "off")
        engine = bench.engine(speculation, early_exit=spec["mode"], max_batch_size=max_batch)
        return engine, greedy.model_copy(update={field: spec["value"]})
    return bench.engine("off" if spec["kind"] == "plain" else "adaptive", max_batch_size=max_batch), greedy


# ----------------------------------------------------------------------------------------- one run
def exit_counters(stats) -> tuple[int, int]:
    """(tokens read out by the exit path, loops they ran) so far."""
    return sum(stats.exit_depth_histogram.values()), stats.num_exit_loops_run


def timed_run(engine, prompts: list[Any], params: SamplingParams) -> tuple[dict[str, Any], list]:
    """One `generate`: decode time and tokens, and the early-exit counters' deltas (tokens read out by the
    exit path, loops they ran)."""
    stats = engine.stats
    prefill0 = stats.phase_seconds["prefill"]
    exited0, loops0 = exit_counters(stats)
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    decode_s = time.perf_counter() - start - (stats.phase_seconds["prefill"] - prefill0)
    decode_tokens = sum(len(o.token_ids) for o in outputs) - len(prompts)  # the first token comes from prefill
    exited1, loops1 = exit_counters(stats)
    return {
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "tokens_per_s": decode_tokens / decode_s if decode_s > 0 else float("nan"),
        "exited_tokens": exited1 - exited0,
        "exit_loops": loops1 - loops0,
    }, outputs


def counted_run(engine, prompts: list[Any], params: SamplingParams) -> tuple[dict[str, Any], list]:
    """One `generate`, untimed (--quality-only): the early-exit counters' deltas."""
    exited0, loops0 = exit_counters(engine.stats)
    outputs = engine.generate(prompts, params)
    exited1, loops1 = exit_counters(engine.stats)
    return {"exited_tokens": exited1 - exited0, "exit_loops": loops1 - loops0}, outputs


# ----------------------------------------------------------------------------------------- quality
@torch.inference_mode()
def nll_under_full_depth(adapter, outputs) -> float:
    """Mean NLL (nats/token) of the committed tokens under the full-depth model, cache-free."""
    total, count = 0.0, 0
    for out in outputs:
        ids = out.prompt_token_ids + out.token_ids
        logits = adapter.dense_logits(torch.tensor(ids))[0, len(out.prompt_token_ids) - 1 : -1]
        total += float(F.cross_entropy(logits, torch.tensor(out.token_ids), reduction="sum"))
        count += len(out.token_ids)
    return total / count


def mean_readout_depth(outputs, depth: int) -> float:
    """Mean loop depth the committed tokens were read out at (D for tokens without early exit)."""
    histogram = {}
    for out in outputs:
        for d, n in out.metrics.exit_depth_histogram.items():
            histogram[d] = histogram.get(d, 0) + n
    exited = sum(histogram.values())
    total = sum(len(o.token_ids) for o in outputs)
    return (sum(d * n for d, n in histogram.items()) + depth * (total - exited)) / total


def agreement(outputs: list[list[int]], reference: list[list[int]]) -> tuple[float, float]:
    """(fraction of positions equal to full-depth greedy, mean matching-prefix fraction)."""
    same = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref))
    total = sum(len(ref) for ref in reference)
    prefixes = []
    for out, ref in zip(outputs, reference):
        n = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        prefixes.append(n / len(ref))
    return same / total, sum(prefixes) / len(prefixes)


# ----------------------------------------------------------------------------------------- batch sizes
def bench_batch(configs, prompts: list[Any], b: int, args, rng: random.Random, bar) -> tuple[dict, dict]:
    """`repeats` interleaved rounds of every configuration at batch size b (round 0 discarded); returns the
    per-round data and each configuration's outputs of the last round."""
    names = list(configs)
    rounds, orders, checks, outputs = [], [], 0, {}

    def run(name):
        engine, params = configs[name]
        return timed_run(engine, prompts[:b], params)

    for r, order, runs, outs in interleaved_rounds(names, args.repeats, rng, bar, run):
        outputs = {name: outs[name] for name in names}  # configs in their order
        reference = [o.token_ids for o in outputs["plain"]]
        for name in FULL_DEPTH_GREEDY:
            check_equal(name, [o.token_ids for o in outputs[name]], reference, f"B={b}, round {r}")
            checks += 1
        for name in names:  # early exit + speculation: the same early-exit model, so the same greedy output
            if twin(name) is not None:
                want = [o.token_ids for o in outputs[twin(name)]]
                check_equal(name, [o.token_ids for o in outputs[name]], want, f"B={b}, round {r}")
                checks += 1
        rounds.append(runs)
        orders.append(order)
    data = {"rounds": rounds, "orders": orders, "equality_checks": checks}
    return data, outputs


def quality_fields(runs: list[dict[str, Any]], outs: list, reference: list[list[int]], adapter) -> dict[str, Any]:
    """Loops per token (over `runs`), mean readout depth, agreement, matching prefix and NLL of `outs`."""
    depth = adapter.full_depth
    exited = sum(x["exited_tokens"] for x in runs)
    agree, prefix = agreement([o.token_ids for o in outs], reference)
    return {
        "loops_per_token": sum(x["exit_loops"] for x in runs) / exited if exited else float(depth),
        "readout_depth": mean_readout_depth(outs, depth),
        "agreement": agree,
        "prefix": prefix,
        "nll": nll_under_full_depth(adapter, outs),
    }


def batch_rows(b: int, data: dict[str, Any], outputs: dict[str, list], adapter) -> list[dict[str, Any]]:
    """One row per configuration: speed over the measured rounds, quality of the last round's outputs."""
    measured = data["rounds"][1:]
    plain_tps = [rd["plain"]["tokens_per_s"] for rd in measured]
    reference = [o.token_ids for o in outputs["plain"]]
    rows = []
    for name, outs in outputs.items():
        runs = [rd[name] for rd in measured]
        rows.append({
            "batch": b,
            "configuration": LABELS.get(name, name),
            "tokens_per_s": statistics.median(x["tokens_per_s"] for x in runs),
            "ratio": spread([x["tokens_per_s"] / p for x, p in zip(runs, plain_tps)]),
            **quality_fields(runs, outs, reference, adapter),
        })  # fmt: skip
    data["plain_tokens_per_s"] = statistics.median(plain_tps)
    data["aa"] = rows[list(outputs).index("plain-B")]["ratio"]
    data["noise_floor"] = noise_floor(data["aa"])
    return rows


def quality_batch(configs, prompts: list[Any], b: int, adapter, bar) -> tuple[dict, list[dict[str, Any]]]:
    """--quality-only: one untimed pass of every configuration at batch size b; (exit counters, rows)."""
    runs, outputs = {}, {}
    for name, (engine, params) in configs.items():
        runs[name], outputs[name] = counted_run(engine, prompts[:b], params)
        bar.update(1)
    reference = [o.token_ids for o in outputs["plain"]]
    rows = [
        {"batch": b, "configuration": LABELS.get(name, name), **quality_fields([runs[name]], outs, reference, adapter)}
        for name, outs in outputs.items()
    ]
    return {"runs": runs}, rows


def print_quality(b: int, rows: list[dict[str, Any]]) -> None:
    print(f"\nB={b} (quality only, no timing)")
    print(f"{'batch':>5} {'configuration':<26} {'loops/tok':>9} {'depth':>5} {'agree':>6} {'prefix':>6} {'NLL':>7}")
    for row in rows:
        print(
            f"{b:>5} {row['configuration']:<26} {row['loops_per_token']:>9.2f} {row['readout_depth']:>5.2f} "
            f"{row['agreement']:>6.1%} {row['prefix']:>6.1%} {row['nll']:>7.3f}"
        )


def print_batch(b: int, data: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    print(f"\nB={b}: plain {data['plain_tokens_per_s']:.1f} decode tok/s (median)")
    print(f"A/A (plain-B vs plain): {fmt(data['aa'])}  noise floor +-{100 * data['noise_floor']:.0f}%")
    print(
        f"{'batch':>5} {'configuration':<26} {'tok/s':>8} {'x plain [min-max]':>20} {'loops/tok':>9} {'depth':>5} "
        f"{'agree':>6} {'prefix':>6} {'NLL':>7}"
    )
    for row in rows:
        print(
            f"{b:>5} {row['configuration']:<26} {row['tokens_per_s']:>8.1f} {fmt(row['ratio']):>20} "
            f"{row['loops_per_token']:>9.2f} {row['readout_depth']:>5.2f} {row['agreement']:>6.1%} "
            f"{row['prefix']:>6.1%} {row['nll']:>7.3f}"
        )


# ----------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--taus", default="0.5,0.7,0.9", help="exit thresholds, in the family rule's units")
    parser.add_argument("--exit-at-steps", default="", help="also fixed depths, e.g. 2,3")
    parser.add_argument(
        "--spec-modes", default="skip", help="modes whose early-exit configurations also run with adaptive "
        "speculation: skip, select, skip,select or none",
    )  # fmt: skip
    parser.add_argument("--prompts", default="eval", type=prompt_source_flag)
    parser.add_argument("--seed", type=int, default=0, help="seeds the run order, the random prompts, every request")
    parser.add_argument("--repeats", type=int, default=4, help="rounds per batch size; the first is discarded")
    parser.add_argument(
        "--quality-only", action="store_true", help="no timing: one pass per configuration (no A/A, no adaptive)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    parser.add_argument("--adapter-option", action="append", metavar="KEY=VALUE", help="passed to the adapter")
    parser.add_argument("--out", default=None, help="write OUT.json (rows and per-round data)")
    args = parser.parse_args(argv)
    if args.quality_only:  # --repeats does not apply
        if args.max_tokens < 2:
            parser.error("--max-tokens must be >= 2 (the first token comes from prefill)")
    else:
        check_rounds(parser, args)
    try:
        args.batches = parse_batch_sizes(args.batch_sizes)
        args.steps = parse_int_list(args.exit_at_steps, "--exit-at-steps") if args.exit_at_steps.strip() else []
        args.tau_list = [float(t) for t in args.taus.split(",") if t.strip()]
    except ValueError as exc:
        parser.error(str(exc))
    modes = [m.strip() for m in args.spec_modes.split(",") if m.strip()]
    if modes == ["none"]:
        modes = []
    if any(m not in ("skip", "select") for m in modes):
        parser.error(f"--spec-modes {args.spec_modes!r}: use skip, select, skip,select or none")
    args.spec_mode_list = modes
    args.parser = parser
    return args


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the sweep, print the table (and write --out); returns its rows."""
    args = parse_args(argv)
    command, now = command_line(argv, "bench_early_exit.py")
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args.model, **parse_adapter_options(args.adapter_option))
    adapter = bench.adapter
    depth = adapter.full_depth
    rules = [("tau", t) for t in args.tau_list] + [("k", k) for k in args.steps]
    if not adapter.has_exit_rule and args.tau_list:
        print(f"note: {adapter.model_type} has no exit signal; the thresholds are skipped (fixed depths only)")
        rules = [(kind, value) for kind, value in rules if kind != "tau"]
    max_batch = max(args.batches)
    try:
        prompts, prompt_desc = load_prompts(args.prompts, max_batch, adapter, seed=args.seed)
    except PromptSetError as exc:
        args.parser.error(str(exc))
    passes = "one untimed pass per configuration" if args.quality_only else f"{args.repeats} rounds"
    print(
        f"model {adapter.name} ({adapter.model_type}) D={depth}, {torch.get_num_threads()} threads; prompts: "
        f"{prompt_desc}; {args.max_tokens} new tokens per request (greedy, eos ignored); {passes} per batch size"
        + ("" if args.quality_only else ", the first discarded")
    )
    if not args.quality_only:
        print(f"ratios: median over the measured rounds of (config tok/s / plain tok/s in the same round); {SPREAD}")
    specs = config_specs(rules, args.spec_mode_list, args.quality_only)
    greedy = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed)
    configs = {name: build(bench, spec, greedy, max_batch) for name, spec in specs.items()}
    overlap = check_overlap({name: engine for name, (engine, _) in configs.items()}, specs, prompts)
    if not args.quality_only:
        for engine, params in configs.values():  # warm up at the full batch shape
            engine.generate(prompts, params.model_copy(update={"max_tokens": 4}))
    rng = random.Random(args.seed)
    bar = _progress((1 if args.quality_only else args.repeats) * len(configs) * len(args.batches))
    table, batch_sizes = [], {}
    try:
        for b in args.batches:
            if args.quality_only:
                data, rows = quality_batch(configs, prompts, b, adapter, bar)
                bar.clear()
                print_quality(b, rows)
            else:
                data, outputs = bench_batch(configs, prompts, b, args, rng, bar)
                rows = batch_rows(b, data, outputs, adapter)
                bar.clear()
                print_batch(b, data, rows)
            table += rows
            batch_sizes[str(b)] = data
    finally:
        bar.close()
        for engine, _ in configs.values():
            engine.close()
    checks = sum(data.get("equality_checks", 0) for data in batch_sizes.values())
    if not args.quality_only:
        print(f"\ngreedy outputs equal to their reference (plain-B, adaptive: plain's; + spec: its early-exit "
              f"twin's): {checks} of {checks} checks")  # fmt: skip
    if args.out:
        report = {
            **run_record(command, now, adapter),
            "args": {k: v for k, v in vars(args).items() if k != "parser"},
            "prompts": {"kind": args.prompts, "description": prompt_desc, "fingerprints": prompt_fingerprints(prompts)},
            "configs": specs,
            "overlap_check": overlap,
            "spread": None if args.quality_only else SPREAD,
            "rows": table,
            "batch_sizes": batch_sizes,
            "equality_checks": checks,
        }
        path = Path(args.out).with_name(Path(args.out).name + ".json")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(report, indent=1, default=str))
        print(f"wrote {path}")
    return table


if __name__ == "__main__":
    main()
