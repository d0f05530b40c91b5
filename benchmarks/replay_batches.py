"""What a fixed (K, d) earns on whole static batches, against its steady-state rate (no timing involved).

A static batch (B prompts, `--max-tokens` new tokens each, eos ignored: bench_speculative.py's batches) decodes
until its last request finishes. Under speculation requests finish at different rounds, and the last rounds run a
few requests at nearly a full round's price. This script replays it exactly: it records each prompt's depth
agreement along its greedy trajectory (`measure_match_bits`, deterministic), replays every plan's rounds per
request on those bits (`simulate_tokens`, the tuner's replay: drafts cut to the tokens left, as the scheduler does)
over batches that rotate through the group as the benchmark's rounds do (batch n from offset 7n), and prices each
round at the batch size it had with a preset's pass-cost profile. Printed per plan, as ratios to plain decoding of
the same batches:

- `steady`: the rate the controller prices, every request at full batch (mean tokens per round ÷ round price);
- `batch`: the whole batches' rate (tokens ÷ the sum of their rounds' prices);
- `fill`: the mean share of the batch still decoding in a round (1.00 for plain: every request ends together).

    python benchmarks/replay_batches.py --model tiny-ouro --prompts code --batch-sizes 8,32
    python benchmarks/replay_batches.py --model tiny-ouro --prompts prose --preset my-presets/tiny-ouro.json

The profile prices rounds of the machine it was timed on (docs/benchmarking.md, "Another machine").
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from looped_spec import load_adapter
from looped_spec.control.passcost import PassCost
from looped_spec.presets.lookup import preset_for
from looped_spec.tuning.acceptance_pass import measure_match_bits, simulate_tokens
from looped_spec.tuning.grid import parse_batch_sizes, parse_grid, prompt_source_flag
from looped_spec.tuning.prompt_sets import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import ROTATION_STRIDE, rotation_size  # noqa: E402


def replay(bits, batch: list[int], k: int, d: int, cost: PassCost, context: float) -> tuple[float, float, float]:
    """(seconds of the whole batch, seconds at steady state, fill) of plan (k, d) on the prompts `batch`: each
    request's rounds replayed on its bits as the tuner replays them (drafts cut to the tokens left)."""
    rounds = [simulate_tokens([bits[d - 1][i]], k)[1] if k else len(bits[0][i]) for i in batch]
    seconds = sum(cost.seconds(k, d, sum(r > t for r in rounds), context) for t in range(max(rounds)))
    steady = statistics.mean(rounds) * cost.seconds(k, d, len(batch), context)
    return seconds, steady, sum(rounds) / (len(batch) * max(rounds))


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-ouro")
    ap.add_argument("--prompts", default="code", type=prompt_source_flag)
    ap.add_argument("--preset", help="the preset whose profile prices rounds (default: the model's own)")
    ap.add_argument("--batch-sizes", default="8,32")
    ap.add_argument("--grid", default="auto", help="'auto', 'full' or 'K,d;K,d' (looped_spec.tuning.grid)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, default=40, help="rotating batches per batch size")
    ap.add_argument("--context", type=float, default=150.0, help="mean context the rounds are priced at")
    args = ap.parse_args(argv)
    if args.max_tokens < 2 or args.batches < 1:
        ap.error("need --max-tokens >= 2 and --batches >= 1")
    torch.set_num_threads(1)
    adapter = load_adapter(args.model)
    depth = adapter.full_depth
    grid = parse_grid(args.grid, depth)
    sizes = parse_batch_sizes(args.batch_sizes)
    preset = preset_for(adapter, args.preset)  # as the engine finds it
    cost = PassCost(preset.cost, depth)
    prompts, described = load_prompts(args.prompts, rotation_size(args.prompts, max(sizes)), adapter)
    bits = measure_match_bits(adapter, prompts, args.max_tokens)
    print(f"{adapter.name} D={depth}; {described}; {args.max_tokens} tokens; priced by preset {preset.model!r} "
          f"({preset.hardware})")  # fmt: skip
    for b in sizes:
        batches = [[(ROTATION_STRIDE * n + i) % len(prompts) for i in range(b)] for n in range(args.batches)]
        plain = [replay(bits, batch, 0, 0, cost, args.context)[0] for batch in batches]
        print(f"B={b}: plan  steady  batch  fill")
        for k, d in grid:
            runs = [replay(bits, batch, k, d, cost, args.context) for batch in batches]
            steady = statistics.median(p / s for p, (_, s, _) in zip(plain, runs))
            whole = statistics.median(p / s for p, (s, _, _) in zip(plain, runs))
            fill = statistics.mean(f for _, _, f in runs)
            print(f"  {k},{d}  {steady:6.3f}  {whole:5.3f}  {fill:4.2f}")


if __name__ == "__main__":
    main()
