"""Decode tokens/s against context length, plain and speculative, at B=1 (prefill excluded).

Contexts are measured interleaved (every round visits every context and mode once) and the median of
the rounds is printed, so slow drift of a shared machine hits all cells alike. With `--compare-slots`
the previous per-slot gather (one index per key) runs beside the block gather, same process.

    python benchmarks/bench_context.py --model tiny-ouro --contexts 16,128,256,512,768,1000 --spec 2,1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import looped_spec.execution.attention as attention
from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
from looped_spec.execution.attention import PagedContext

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


def decode_tps(engine: LoopedSpecEngine, prompt: list[int], new_tokens: int) -> float:
    prefill0 = engine.stats.phase_seconds["prefill"]
    start = time.perf_counter()
    engine.generate([prompt], SamplingParams(max_tokens=new_tokens, ignore_eos=True))
    seconds = time.perf_counter() - start - (engine.stats.phase_seconds["prefill"] - prefill0)
    return (new_tokens - 1) / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--contexts", default="16,128,256,512,768,1000")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--spec", default="2,1", help="the speculative config (K,d) measured beside plain")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--compare-slots", action="store_true", help="also time the old per-slot gather")
    parser.add_argument("--breakdown", action="store_true", help="print time per token in gather and SDPA")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    adapter = load_adapter(args.model)
    contexts = [int(c) for c in args.contexts.split(",")]
    max_len = min(adapter.max_positions, max(contexts) + args.new_tokens + 1)
    engines = {m: LoopedSpecEngine(adapter, speculation=m, max_batch_size=1, max_model_len=max_len)
               for m in ("off", args.spec)}  # fmt: skip
    gathers = {"block": PagedContext.gather}
    if args.compare_slots:
        gathers["slot"] = slot_gather
    if args.breakdown:
        gathers = {name: timed("gather", fn, lambda ctx, plane: ctx.max_query == 1) for name, fn in gathers.items()}
        attention._sdpa = timed("sdpa", attention._sdpa, lambda q, *rest: q.shape[2] == 1)
    spent: dict = {}
    prompt_of = {c: [3 + (7 * i) % (adapter.vocab_size - 3) for i in range(c)] for c in contexts}
    cells = [(c, m, g) for c in contexts for m in engines for g in gathers]
    for c, m, g in cells:  # warm-up
        PagedContext.gather = gathers[g]
        engines[m].generate([prompt_of[c]], SamplingParams(max_tokens=2, ignore_eos=True))
    times: dict = {cell: [] for cell in cells}
    for _ in range(args.rounds):
        for cell in cells:
            c, m, g = cell
            PagedContext.gather = gathers[g]
            SPENT.update(gather=0.0, sdpa=0.0)
            times[cell].append(decode_tps(engines[m], prompt_of[c], args.new_tokens))
            # per decoded token
            spent.setdefault(cell, []).append({k: v / (args.new_tokens - 1) for k, v in SPENT.items()})
    PagedContext.gather = gathers["block"]
    print(f"model {adapter.name}, B=1, {args.new_tokens} new tokens, median of {args.rounds} interleaved rounds "
          f"(spread = (max-min)/median); torch threads {args.threads}")  # fmt: skip
    header = "context" + "".join(
        f" | {m if m != 'off' else 'plain'} {g} tok/s (spread)" for m in engines for g in gathers
    )
    print(header)
    for c in contexts:
        row = f"{c:7d}"
        for m in engines:
            for g in gathers:
                values = times[(c, m, g)]
                med = statistics.median(values)
                row += f" | {med:10.1f} ({(max(values) - min(values)) / med:4.0%})"
        print(row)
    if args.breakdown:
        print("\nmicroseconds per decoded token: gather, SDPA (one-token calls: decode, draft), the rest; medians")
        for c in contexts:
            row = f"{c:7d}"
            for m in engines:
                for g in gathers:
                    parts = spent[(c, m, g)]
                    gather = statistics.median(p["gather"] for p in parts) * 1e6
                    sdpa = statistics.median(p["sdpa"] for p in parts) * 1e6
                    total = 1e6 / statistics.median(times[(c, m, g)])
                    row += (
                        f" | {m if m != 'off' else 'plain'} {g}: {gather:6.0f} {sdpa:6.0f} {total - gather - sdpa:6.0f}"
                    )
            print(row)


if __name__ == "__main__":
    main()
