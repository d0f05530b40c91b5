"""Plain decoding through the paged KV path vs a naive loop that re-runs `dense_logits` on the growing sequence.

Prints, per batch size, tokens/s of both and their ratio, measured side by side in one process.

    python benchmarks/bench_plain.py --model tests/fixtures/ouro-tiny --batch-sizes 1,8,32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import time

import torch
from common import Bench

from looped_spec.tuning.grid import parse_batch_sizes
from looped_spec.tuning.prompt_sets import random_prompts


def naive_dense(adapter, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
    """Greedy decoding with no cache: the whole (equal-length) batch re-run at full depth per token."""
    seqs = torch.tensor(prompts)
    start = time.perf_counter()
    for _ in range(max_tokens):
        nxt = adapter.dense_logits(seqs)[:, -1].argmax(-1)
        seqs = torch.cat([seqs, nxt[:, None]], dim=1)
    return time.perf_counter() - start, seqs[:, len(prompts[0]) :].tolist()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tests/fixtures/ouro-tiny")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args.model, **({"initial_state": "zeros"} if "huginn" in args.model else {}))
    print(f"model {bench.adapter.name} D={bench.adapter.full_depth}  max_tokens={args.max_tokens}")
    print(f"{'batch':>5} {'paged tok/s':>12} {'naive tok/s':>12} {'paged/naive':>12}  same tokens")
    try:
        batches = parse_batch_sizes(args.batch_sizes)
    except ValueError as exc:
        parser.error(str(exc))
    for batch in batches:
        prompts = [p[: args.prompt_len] + [3] * (args.prompt_len - len(p)) for p in random_prompts(batch, 200)]
        paged = bench.run(bench.engine("off"), prompts, args.max_tokens)
        naive_s, naive_out = naive_dense(bench.adapter, prompts, args.max_tokens)
        naive_tps = batch * args.max_tokens / naive_s
        same = naive_out == paged["outputs"]
        print(
            f"{batch:>5} {paged['tokens_per_s']:>12.1f} {naive_tps:>12.1f} {paged['tokens_per_s'] / naive_tps:>11.2f}x"
            f"  {same}"
        )


if __name__ == "__main__":
    main()
