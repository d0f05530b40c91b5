"""Plain vs fixed (K, d) grid vs adaptive speculation, side by side in one process.

For each batch size: tokens/s of every configuration as a ratio to plain decoding, measured
acceptance, tokens per round, and the DESIGN.md cost model fitted to the measured phase times
(predicted ratio beside the measured one). Optionally the changing workload 1->8->32->8->1,
counterfactual acceptance per depth, a JSON report and a PNG heatmap.

    python benchmarks/bench_speculative.py --model tests/fixtures/ouro-tiny --batch-sizes 1,8,32
    python benchmarks/bench_speculative.py --model tiny-ouro --prompts mixed --adaptive --workload \
        --out benchmarks/results/tiny-ouro
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from datetime import date
from pathlib import Path

import torch
from common import Bench, prompt_set
from costmodel_fit import fit_cost_model, predicted_ratio

from looped_spec import SpeculativeConfig
from looped_spec.tuner_report import write_heatmap


def parse_grid(text: str, depth: int) -> list[tuple[int, int]]:
    if text == "auto":
        ks = [1, 2, 3, 5]
        ds = sorted({1, max(1, depth // 2), depth - 1})
        return [(k, d) for k in ks for d in ds if d < depth]
    return [tuple(int(x) for x in item.split(",")) for item in text.split(";")]


def depth_acceptance(bench: Bench, prompts: list, max_tokens: int, d: int) -> list[float]:
    """Greedy agreement of each depth's readout with the committed token (counterfactual measurement)."""
    engine = bench.engine(SpeculativeConfig(k=2, d=d, measure_depths=True))
    totals = [0] * bench.adapter.full_depth
    trials = [0] * bench.adapter.full_depth
    seen = []
    engine.controller.observe = seen.append
    engine.generate(prompts, _params(max_tokens))
    for fb in seen:
        for i, (m, t) in enumerate(zip(fb.depth_matches, fb.depth_trials)):
            totals[i] += m
            trials[i] += t
    return [m / t if t else 0.0 for m, t in zip(totals, trials)]


def _params(max_tokens: int):
    from looped_spec import SamplingParams

    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def changing_workload(bench: Bench, prompts: list, max_tokens: int, phases: list[int], configs: dict) -> dict:
    """Run batches of sizes `phases` back to back on one engine per config; total tokens/s as ratio to plain."""
    out = {}
    for name, (spec, policy) in configs.items():
        engine = bench.engine(spec, policy=policy)
        engine.generate(prompts[:2], _params(4))
        start = time.perf_counter()
        prefill0 = engine.stats.phase_seconds["prefill"]
        tokens = 0
        for size in phases:
            outs = engine.generate(prompts[:size], _params(max_tokens))
            tokens += sum(len(o.token_ids) - 1 for o in outs)
        decode_seconds = time.perf_counter() - start - (engine.stats.phase_seconds["prefill"] - prefill0)
        out[name] = {
            "tokens_per_s": tokens / decode_seconds,
            "plans": dict(engine.stats.plan_histogram),
            "acceptance": engine.stats.acceptance_rate,
        }
        engine.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tests/fixtures/ouro-tiny")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--grid", default="auto", help='"K,d;K,d;..." or auto')
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompts", default="mixed", choices=["random", "humaneval", "heldout", "mixed"])
    parser.add_argument("--repeats", type=int, default=3, help="median of this many timed runs per cell")
    parser.add_argument("--adaptive", action="store_true", help="also run speculation='adaptive' (ema and goodput)")
    parser.add_argument("--workload", action="store_true", help="also run the changing workload 1->8->32->8->1")
    parser.add_argument("--out", default=None, help="write OUT.json and OUT.png")
    parser.add_argument("--threads", type=int, default=0)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {"initial_state": "zeros"} if "huginn" in args.model else {}
    bench = Bench(args.model, **options)
    depth = bench.adapter.full_depth
    grid = parse_grid(args.grid, depth)
    batches = [int(b) for b in args.batch_sizes.split(",")]
    prompts = prompt_set(args.prompts, max(batches), bench.adapter)
    print(
        f"model {bench.adapter.name} ({bench.adapter.model_type}) D={depth}, prompts={args.prompts}, "
        f"max_tokens={args.max_tokens}, {torch.get_num_threads()} threads, {platform.processor() or 'cpu'}"
    )
    results: dict = {}
    samples = []
    for b in batches:
        batch_prompts = prompts[:b]
        plain_engine = bench.engine("off")
        plain = bench.run(plain_engine, batch_prompts, args.max_tokens, args.repeats)
        k0 = bench.run(bench.engine(SpeculativeConfig(k=0, d=1)), batch_prompts, args.max_tokens, args.repeats)
        runs = {}
        for k, d in grid:
            res = bench.run(bench.engine(SpeculativeConfig(k=k, d=d)), batch_prompts, args.max_tokens, args.repeats)
            assert res["outputs"] == plain["outputs"], f"greedy output changed at K={k} d={d} B={b}"
            runs[(k, d)] = res
        # plain again after the grid: ratios use the mean of both, and their spread shows the noise floor
        plain_end = bench.run(plain_engine, batch_prompts, args.max_tokens, args.repeats)
        plain_tps = 0.5 * (plain["tokens_per_s"] + plain_end["tokens_per_s"])
        row = {
            "plain_tokens_per_s": plain_tps,
            "plain_drift": plain_end["tokens_per_s"] / plain["tokens_per_s"],
            "k0_ratio": k0["tokens_per_s"] / plain_tps,
            "grid": {},
            "adaptive": {},
        }
        samples.append(("plain", b, 0, depth, plain))
        print(
            f"\nB={b}: plain {plain_tps:.1f} decode tok/s (end/start {row['plain_drift']:.2f}); "
            f"K=0 spec config {row['k0_ratio']:.2f}x plain"
        )
        print(f"{'K':>3} {'d':>3} {'ratio':>7} {'accept':>7} {'tok/round':>9}")
        for (k, d), res in runs.items():
            ratio = res["tokens_per_s"] / plain_tps
            row["grid"][f"{k},{d}"] = {
                "ratio": ratio,
                "acceptance": res["acceptance"],
                "tokens_per_round": res["tokens_per_round"],
            }
            samples.append(("spec", b, k, d, res))
            print(f"{k:>3} {d:>3} {ratio:>6.2f}x {res['acceptance']:>7.2f} {res['tokens_per_round']:>9.2f}")
        # cost of the counterfactual depth readouts (measure_depths) at one plan
        k_m, d_m = grid[0]
        plain_m = bench.run(bench.engine(SpeculativeConfig(k=k_m, d=d_m)), batch_prompts, args.max_tokens, args.repeats)
        measured = bench.run(
            bench.engine(SpeculativeConfig(k=k_m, d=d_m, measure_depths=True)),
            batch_prompts,
            args.max_tokens,
            args.repeats,
        )
        row["measure_depths_cost"] = plain_m["tokens_per_s"] / measured["tokens_per_s"] - 1.0
        print(f"measure_depths at K={k_m},d={d_m}: {100 * row['measure_depths_cost']:+.1f}% time per token")
        if args.adaptive:
            for policy in ("ema", "goodput"):
                engine = bench.engine("adaptive", policy=policy)
                res = bench.run(engine, batch_prompts, args.max_tokens, args.repeats)
                assert res["outputs"] == plain["outputs"], f"adaptive ({policy}) changed greedy output at B={b}"
                overhead = engine.stats.phase_seconds["control"] / max(engine.stats.num_rounds, 1)
                row["adaptive"][policy] = {
                    "ratio": res["tokens_per_s"] / plain_tps,
                    "acceptance": res["acceptance"],
                    "plans": dict(engine.stats.plan_histogram),
                    "control_us_per_round": overhead * 1e6,
                }
                print(
                    f"adaptive/{policy}: {row['adaptive'][policy]['ratio']:.2f}x, acceptance "
                    f"{res['acceptance']:.2f}, controller {overhead * 1e6:.0f} us/round"
                )
        results[b] = row
    fit = fit_cost_model(samples, depth)
    print("\ncost model fit (per loop-step: draft a0 + a1*B, verify b0 + b1*B(K+1)):", fit["coefficients"])
    print(f"{'B':>3} {'K':>3} {'d':>3} {'measured':>9} {'predicted':>9}")
    for b in batches:
        for key, cell in results[b]["grid"].items():
            k, d = (int(x) for x in key.split(","))
            cell["predicted_ratio"] = predicted_ratio(fit, b, k, d, depth, cell["acceptance"])
            print(f"{b:>3} {k:>3} {d:>3} {cell['ratio']:>8.2f}x {cell['predicted_ratio']:>8.2f}x")
    report = {
        "date": str(date.today()),
        "model": bench.adapter.name,
        "depth": depth,
        "prompts": args.prompts,
        "max_tokens": args.max_tokens,
        "threads": torch.get_num_threads(),
        "results": results,
        "cost_model": fit,
    }
    sample_prompts = prompts[: min(8, len(prompts))]
    report["depth_acceptance"] = depth_acceptance(bench, sample_prompts, args.max_tokens, 1)
    print(
        "\ngreedy agreement of depth-i readout with the committed token:",
        " ".join(f"d{i + 1}={a:.2f}" for i, a in enumerate(report["depth_acceptance"])),
    )
    if args.workload:
        best = {b: max(results[b]["grid"].items(), key=lambda kv: kv[1]["ratio"])[0] for b in batches}
        phases = [1, 8, 32, 8, 1]
        wl = changing_workload(
            bench,
            prompts if len(prompts) >= 32 else prompts * 32,
            args.max_tokens,
            phases,
            {
                "plain": ("off", "ema"),
                f"fixed-best-B{batches[0]} ({best[batches[0]]})": (best[batches[0]], "ema"),
                f"fixed-best-B{batches[-1]} ({best[batches[-1]]})": (best[batches[-1]], "ema"),
                "adaptive-ema": ("adaptive", "ema"),
                "adaptive-goodput": ("adaptive", "goodput"),
            },
        )
        base = wl["plain"]["tokens_per_s"]
        print("\nchanging workload 1->8->32->8->1:")
        for name, cell in wl.items():
            cell["ratio"] = cell["tokens_per_s"] / base
            print(f"  {name:<24} {cell['ratio']:.2f}x  acceptance {cell['acceptance']:.2f}  plans {cell['plans']}")
        report["workload"] = wl
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.with_suffix(".json").write_text(json.dumps(report, indent=1, default=str))
        cells = {b: {"screen": {"cells": results[b]["grid"]}} for b in batches}
        skipped = write_heatmap(cells, out.with_suffix(".png"), title=f"{bench.adapter.name}: {args.prompts} prompts")
        if skipped:
            print(skipped)
        print(f"\nwrote {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
