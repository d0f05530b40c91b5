"""Decode tokens/s against context length, plain and speculative, at B=1 (prefill excluded), side by side.

One process, one loaded model, one persistent engine per configuration: `plain`, `plain-B` (a second identical
engine: the A/A control) and the speculative config `--spec` (K,d); with `--compare-slots` also `plain slot` and
`<spec> slot`, which run the previous per-slot gather (one index per key) in place of the block gather. Every round
visits every context in a shuffled order and, at each, runs every configuration once (one whole `generate` of the
same prompt) in an order shuffled afresh, so the ratios of a context are taken seconds apart at most and slow drift
of a shared machine hits all cells alike. The first round is a warm-up and is discarded. Printed per context:
plain's decode tokens/s (median over the measured rounds), the A/A line (plain-B ÷ plain), and per configuration
its tokens/s and its ratio to plain (the median over the measured rounds of config tok/s ÷ plain tok/s of the same
round, with its spread). Greedy outputs are checked token for token against plain's of the same round.

    python benchmarks/bench_context.py --model tiny-ouro --contexts 16,128,256,512,768,1000 --spec 2,1 --threads 1
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

import looped_spec.execution.attention as attention
from looped_spec import LoopedSpecEngine
from looped_spec.execution.attention import PagedContext
from looped_spec.tuning.grid import parse_int_list

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import SPREAD, _progress, check_equal, fmt, interleaved_rounds, spread, timed_generate  # noqa: E402
from common import check_model, load_model  # noqa: E402

SPENT = {"gather": 0.0, "sdpa": 0.0}  # seconds of one-token-per-request calls (decode, draft) (--breakdown)


def timed(part: str, fn, one_query):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        if one_query(*args):  # leaves out prefill (and verify) calls
            SPENT[part] += time.perf_counter() - start
        return out

    return wrapper


def slot_gather(self: PagedContext, plane_index) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather this project used before: one index per key slot (for --compare-slots)."""
    num_planes, num_slots, kv_heads, head_dim = self.key_cache.shape
    slots = (self.block_table[:, :, None] * self.block_size + torch.arange(self.block_size)).view(self.num_reqs, -1)
    slots = slots[:, : self.num_keys] + plane_index * num_slots
    out = []
    for cache in (self.key_cache, self.value_cache):
        out.append(cache.view(-1, kv_heads, head_dim)[slots].transpose(1, 2))
    return out[0], out[1]


def main(argv: list[str] | None = None) -> dict[int, dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--contexts", default="16,128,256,512,768,1000")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--spec", default="2,1", help="the speculative config (K,d) measured beside plain")
    parser.add_argument("--rounds", type=int, default=5, help="rounds; the first is discarded")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0, help="seeds the run order of every round")
    parser.add_argument("--compare-slots", action="store_true", help="also time the old per-slot gather")
    parser.add_argument("--breakdown", action="store_true", help="print time per token in gather and SDPA")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.new_tokens < 2 or args.threads < 0:
        parser.error("need --rounds >= 2 (the first is a discarded warm-up), --new-tokens >= 2 (the first token is "
                     "prefill's) and --threads >= 0 (0: torch's default)")  # fmt: skip
    try:
        contexts = parse_int_list(args.contexts, "--contexts")
        check_model(args.model)
    except ValueError as exc:
        parser.error(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_model(parser, args.model)
    max_len = min(adapter.max_positions, max(contexts) + args.new_tokens + 1)
    # put back at the end (--breakdown wraps both): main() leaves the process as it found it
    block_gather, plain_sdpa = PagedContext.gather, attention.sdpa
    gathers = {"block": block_gather}
    if args.compare_slots:
        gathers["slot"] = slot_gather
    if args.breakdown:
        gathers = {name: timed("gather", fn, lambda ctx, plane: ctx.max_query == 1) for name, fn in gathers.items()}
        # attention.py's module-level name, which its `_attend` calls
        attention.sdpa = timed("sdpa", plain_sdpa, lambda q, *rest: q.shape[2] == 1)
    configs = {"plain": ("off", "block"), "plain-B": ("off", "block"), args.spec: (args.spec, "block")}
    if args.compare_slots:
        configs |= {"plain slot": ("off", "slot"), f"{args.spec} slot": (args.spec, "slot")}
    try:
        engines = {name: LoopedSpecEngine(adapter, speculation=speculation, max_batch_size=1, max_model_len=max_len)
                   for name, (speculation, _) in configs.items()}  # fmt: skip
    except ValueError as exc:  # a --spec the engine does not take
        parser.error(f"--spec {args.spec}: {exc}")
    prompt_of = {c: [3 + (7 * i) % (adapter.vocab_size - 3) for i in range(c)] for c in contexts}

    def run(name: str, context: int) -> tuple[dict, list]:
        PagedContext.gather = gathers[configs[name][1]]
        SPENT.update(gather=0.0, sdpa=0.0)
        record, outputs = timed_generate(engines[name], [prompt_of[context]], args.new_tokens)
        record["spent"] = {k: v / record["decode_tokens"] for k, v in SPENT.items()}  # per decoded token
        return record, outputs

    rng = random.Random(args.seed)
    bar = _progress(args.rounds * len(contexts) * len(configs))
    measured: dict[int, list[dict]] = {c: [] for c in contexts}
    try:
        for r in range(args.rounds):
            order = list(contexts)
            rng.shuffle(order)
            for c in order:  # one round of every configuration at this context, their order shuffled
                for _, _, records, outs in interleaved_rounds(list(configs), 1, rng, bar, lambda n, c=c: run(n, c)):
                    for name in list(configs)[1:]:  # every configuration but plain itself
                        check_equal(name, outs[name], outs["plain"], f"context {c}, round {r}")
                    if r:  # round 0 is the warm-up
                        measured[c].append(records)
    finally:
        PagedContext.gather, attention.sdpa = block_gather, plain_sdpa
        bar.close()
    print(f"model {adapter.name}, B=1, {args.new_tokens} new tokens, {args.rounds} rounds (first discarded), contexts "
          f"and configurations in an order shuffled per round; {torch.get_num_threads()} threads")  # fmt: skip
    print(f"ratios: median over the measured rounds of (config tok/s / plain tok/s in the same round); {SPREAD}")
    results = {}
    for c in contexts:
        rounds = measured[c]
        tps = {name: [rd[name]["tokens_per_s"] for rd in rounds] for name in configs}
        row = {name: {"tokens_per_s": statistics.median(tps[name]),
                      "ratio": spread([x / p for x, p in zip(tps[name], tps["plain"])])}
               for name in configs}  # fmt: skip
        results[c] = row
        print(f"\ncontext {c}: plain {row['plain']['tokens_per_s']:.1f} decode tok/s (median); "
              f"A/A (plain-B vs plain): {fmt(row['plain-B']['ratio'])}")  # fmt: skip
        for name in configs:
            if name in ("plain", "plain-B"):
                continue
            print(f"  {name:<12} {row[name]['tokens_per_s']:10.1f} tok/s  {fmt(row[name]['ratio'])} plain")
        if args.breakdown:
            print("  microseconds per decoded token: gather, SDPA (one-token calls: decode, draft), the rest; medians")
            for name in configs:
                gather = statistics.median(rd[name]["spent"]["gather"] for rd in rounds) * 1e6
                sdpa = statistics.median(rd[name]["spent"]["sdpa"] for rd in rounds) * 1e6
                total = 1e6 / row[name]["tokens_per_s"]
                print(f"  {name:<12} {gather:6.0f} {sdpa:6.0f} {total - gather - sdpa:6.0f}")
    return results


if __name__ == "__main__":
    main()
