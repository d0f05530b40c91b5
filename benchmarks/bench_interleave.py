"""How to interleave timed runs: whole generates, turns of a few ms, or single steps - spread and bias of each.

bench_speculative.py times its configurations in one round "at once": the engines take turns of at least
`--slice-ms` of decode steps. This script is the evidence for that choice (docs/benchmarking.md). Per round it
times plain, plain-B (the A/A control) and a few fixed (K, d) engines on the same B prompts in each of the modes
below, the modes alternating round by round, and prints per mode and configuration the median ratio to plain
with the standard deviation of the per-round log-ratios and the standard error of the median (1.25 sd / sqrt(n)).

- `generate`: one whole `generate` per engine, one after another in a shuffled order (the old way);
- `slice`: turns of at least `--slice-ms` of steps (`timed_slices`, bench_speculative.py's default);
- `step`: turns of one step each.

A mode whose ratios for the speculative cells differ from `generate`'s by more than their standard errors is
biased (one step at a time charges the switch between engines per step, and plain decoding takes more steps);
among the unbiased ones the smaller spread wins.

    python benchmarks/bench_interleave.py --model tiny-ouro --batch-size 1 --rounds 80 --threads 1
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

import torch

from looped_spec import LoopedSpecEngine, SpeculativeConfig, load_adapter
from looped_spec.tuning.grid import parse_grid, prompt_source_flag
from looped_spec.tuning.prompt_sets import PromptSetError, load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import timed_generate, timed_slices  # noqa: E402

MODES = ("generate", "slice", "step")


def time_round(mode: str, engines: dict[str, LoopedSpecEngine], prompts, args, rng: random.Random) -> dict[str, float]:
    """Decode seconds of every engine in one round of `mode`."""
    if mode == "generate":
        order = list(engines)
        rng.shuffle(order)
        return {name: timed_generate(engines[name], prompts, args.max_tokens)[0]["decode_s"] for name in order}
    slice_s = args.slice_ms / 1000.0 if mode == "slice" else 1e-9  # 1e-9: every turn is a single step
    done = timed_slices(engines, prompts, args.max_tokens, slice_s, rng)
    return {name: record["decode_s"] for name, (record, _) in done.items()}


def summary(rounds: list[dict[str, float]], name: str) -> tuple[float, float, float]:
    """(median ratio to plain, sd of the log-ratios, standard error of the median) over `rounds`."""
    logs = [math.log(rd["plain"] / rd[name]) for rd in rounds]
    sd = statistics.pstdev(logs)
    return math.exp(statistics.median(logs)), sd, 1.25 * sd / math.sqrt(len(logs))


def main(argv: list[str] | None = None) -> dict[str, dict[str, tuple[float, float, float]]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tests/fixtures/ouro-tiny")
    parser.add_argument("--prompts", default="eval", type=prompt_source_flag)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument(
        "--grid", default="3,2;1,1;5,1", help='fixed cells "K,d;K,d" (default 3,2;1,1;5,1), auto or full'
    )
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40, help="rounds per mode; the first of each is discarded")
    parser.add_argument("--modes", default="generate,slice,step")
    parser.add_argument("--slice-ms", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    if not modes or any(m not in MODES for m in modes):
        parser.error(f"--modes: a comma list of {', '.join(MODES)}")
    if args.rounds < 3 or args.batch_size < 1 or args.max_tokens < 2 or not args.slice_ms > 0.0:
        parser.error("need --rounds >= 3, --batch-size >= 1, --max-tokens >= 2 and --slice-ms > 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_adapter(args.model)
    try:
        grid = parse_grid(args.grid, adapter.full_depth)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        prompts, described = load_prompts(args.prompts, args.batch_size, adapter, seed=args.seed)
    except PromptSetError as exc:
        parser.error(str(exc))
    # the whole batch at once: with the engine's default max_batch_size (32) a larger one would decode in waves
    batch = {"max_batch_size": args.batch_size}
    engines = {name: LoopedSpecEngine(adapter, speculation="off", **batch) for name in ("plain", "plain-B")}
    for k, d in grid:
        engines[f"{k},{d}"] = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=k, d=d), **batch)
    print(f"{adapter.name}, B={args.batch_size}, {described}, {args.max_tokens} new tokens, {args.rounds} rounds/mode")
    rng = random.Random(args.seed)
    rounds: dict[str, list[dict[str, float]]] = {m: [] for m in modes}
    for _ in range(args.rounds):  # the modes alternate round by round, so they see the same machine on average
        for mode in modes:
            rounds[mode].append(time_round(mode, engines, prompts, args, rng))
    results: dict[str, dict[str, tuple[float, float, float]]] = {}
    print(f"{'mode':<9} " + " ".join(f"{name:>26}" for name in engines if name != "plain"))
    for mode in modes:
        results[mode] = {name: summary(rounds[mode][1:], name) for name in engines if name != "plain"}
        cells = [f"{m:.3f}x sd {sd:.3f} se {se:.3f}" for m, sd, se in results[mode].values()]
        print(f"{mode:<9} " + " ".join(f"{c:>26}" for c in cells))
    return results


if __name__ == "__main__":
    main()
