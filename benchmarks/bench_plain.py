"""Plain decoding through the paged KV path vs a naive loop that re-runs `dense_logits` on the growing sequence.

Side by side in one process, on one loaded model: `plain` (a persistent engine, speculation off), `plain-B` (a
second identical engine: the A/A control) and `naive` (no cache: the whole equal-length batch re-run at full depth
per token). For each batch size the benchmark runs `--repeats` rounds; in each every configuration decodes the same
B random-token prompts once (greedy, `--max-tokens` new tokens, eos ignored), in an order shuffled per round
(bench_speculative.py's `interleaved_rounds`). The first round is a warm-up and is discarded. Decode time leaves
out the first token of each request: the engines' prefill, and the naive loop's first forward, its counterpart.
Printed per batch size: plain's decode tokens/s (median), paged ÷ naive (the median over the measured rounds of
plain tok/s ÷ naive tok/s of the same round, with its spread) and the A/A line (plain-B ÷ plain) beside it, and
whether all three decoded the same tokens in every round.

    python benchmarks/bench_plain.py --model tests/fixtures/ouro-tiny --batch-sizes 1,8,32 --max-tokens 32
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from bench_speculative import SPREAD, _progress, check_rounds, fmt, interleaved_rounds, spread, timed_generate
from common import Bench, check_model

from looped_spec.tuning.grid import parse_batch_sizes
from looped_spec.tuning.prompt_sets import random_prompts

CONFIGS = ("plain", "plain-B", "naive")


def naive_dense(adapter, prompts: list[list[int]], max_tokens: int) -> tuple[dict, list[list[int]]]:
    """Greedy decoding with no cache: the whole (equal-length) batch re-run at full depth per token. Timed as
    `timed_generate` times an engine: the first forward (the prompt's, which gives the first token) is the prefill,
    left out of decode time and tokens."""
    seqs = torch.tensor(prompts)
    start = time.perf_counter()
    prefill_s = 0.0
    for i in range(max_tokens):
        nxt = adapter.dense_logits(seqs)[:, -1].argmax(-1)
        seqs = torch.cat([seqs, nxt[:, None]], dim=1)
        if i == 0:
            prefill_s = time.perf_counter() - start
    decode_s = time.perf_counter() - start - prefill_s
    decode_tokens = len(prompts) * (max_tokens - 1)
    record = {"decode_s": decode_s, "decode_tokens": decode_tokens, "tokens_per_s": decode_tokens / decode_s}
    return record, seqs[:, len(prompts[0]) :].tolist()


def main(argv: list[str] | None = None) -> dict[int, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tests/fixtures/ouro-tiny")
    parser.add_argument("--batch-sizes", default="1,8,32")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=5, help="rounds per batch size; the first is discarded")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the run order of every round")
    args = parser.parse_args(argv)
    check_rounds(parser, args)
    if args.prompt_len < 1 or args.threads < 0:
        parser.error("need --prompt-len >= 1 and --threads >= 0 (0: torch's default)")
    try:  # before the model loads
        batches = parse_batch_sizes(args.batch_sizes)
        check_model(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args.model, **({"initial_state": "zeros"} if "huginn" in args.model else {}))
    # one persistent engine per configuration, the largest batch decoding at once (not in waves)
    engines = {name: bench.engine("off", max_batch_size=max(batches)) for name in ("plain", "plain-B")}
    print(f"model {bench.adapter.name} D={bench.adapter.full_depth}  max_tokens={args.max_tokens}  "
          f"{args.repeats} rounds per batch size (first discarded), order shuffled per round; "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print(f"ratios: median over the measured rounds of the per-round ratio; {SPREAD}")
    print(f"{'batch':>5} {'plain tok/s':>12} {'paged/naive':>26} {'A/A (plain-B/plain)':>26}  same tokens")
    rng = random.Random(args.seed)
    bar = _progress(args.repeats * len(CONFIGS) * len(batches))
    results = {}
    for batch in batches:
        prompts = [p[: args.prompt_len] + [3] * (args.prompt_len - len(p)) for p in random_prompts(batch, 200)]

        def run(name: str, prompts=prompts) -> tuple[dict, list[list[int]]]:
            if name == "naive":
                return naive_dense(bench.adapter, prompts, args.max_tokens)
            return timed_generate(engines[name], prompts, args.max_tokens)

        measured, same = [], True
        for r, _, records, outs in interleaved_rounds(list(CONFIGS), args.repeats, rng, bar, run):
            same = same and outs["naive"] == outs["plain"] == outs["plain-B"]
            if r:  # round 0 is the warm-up
                measured.append(records)
        tps = {name: [rd[name]["tokens_per_s"] for rd in measured] for name in CONFIGS}
        row = {
            "plain_tokens_per_s": statistics.median(tps["plain"]),
            "paged_vs_naive": spread([p / n for p, n in zip(tps["plain"], tps["naive"])]),
            "aa": spread([b / p for b, p in zip(tps["plain-B"], tps["plain"])]),
            "same_tokens": same,
        }
        results[batch] = row
        bar.clear()
        print(f"{batch:>5} {row['plain_tokens_per_s']:>12.1f} {fmt(row['paged_vs_naive']):>26} {fmt(row['aa']):>26}"
              f"  {same}")  # fmt: skip
    bar.close()
    return results


if __name__ == "__main__":
    main()
