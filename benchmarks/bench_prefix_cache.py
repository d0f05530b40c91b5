"""Prefix caching against the same engine without it, on requests that share a long start (a system prompt).

One process, three persistent engines on one adapter: `plain` and `plain-B` (no prefix cache: the A/A line) and
`cached` (`prefix_caching=True`). Each round every engine runs the same batch of B requests (one `generate`), in a
shuffled order; a request is the shared start (`--shared-tokens` tokens of the evaluation text) followed by a
question of its own (`--own-tokens` tokens of another evaluation prompt, new ones every round). The cached engine's
blocks persist across rounds, as a server's do: from the second round on every request finds the shared start
cached. The first round is discarded; the script prints the median over the rest of plain ÷ other wall time
(throughput) and of the median time to first token, each with the range of the per-round ratios, the prompt tokens
the cached engine took from its cache, and whether the outputs (greedy) were identical every round.

    python benchmarks/bench_prefix_cache.py --model tiny-ouro --batch-size 8 --rounds 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
from looped_spec.tuning.prompt_sets import load_prompts

ENGINES = ("plain", "plain-B", "cached")


def token_prompts(adapter, engine: LoopedSpecEngine, count: int, seed: int) -> list[list[int]]:
    """Evaluation prompts as token ids (random ids for a checkpoint without a tokenizer)."""
    prompts, _ = load_prompts("eval", count, adapter, seed=seed, purpose="eval")
    if engine.tokenizer is None:
        return [list(p) for p in prompts]
    return [engine.tokenizer.encode(p) if isinstance(p, str) else list(p) for p in prompts]


def time_to_first_token(out) -> float:
    return out.metrics.first_token_time - out.metrics.arrival_time


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shared-tokens", type=int, default=256, help="tokens every request starts with")
    parser.add_argument("--own-tokens", type=int, default=16, help="tokens of each request's own after the start")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--speculation", default="off", help="off | adaptive | K,d (all three engines)")
    parser.add_argument("--rounds", type=int, default=8, help="rounds; the first is discarded")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 2 or args.batch_size < 1 or args.shared_tokens < 1 or args.own_tokens < 1:
        parser.error("need --rounds >= 2, --batch-size >= 1, --shared-tokens >= 1 and --own-tokens >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_adapter(args.model, dtype="float32", device="cpu")
    length = args.shared_tokens + args.own_tokens + args.max_tokens + 1
    engines = {
        name: LoopedSpecEngine(
            adapter,
            speculation=args.speculation,
            max_batch_size=args.batch_size,
            max_model_len=length,
            prefix_caching=name == "cached",
        )  # fmt: skip
        for name in ENGINES
    }
    texts = token_prompts(adapter, engines["plain"], args.batch_size * args.rounds + 64, args.seed)
    shared = [t for text in texts for t in text][: args.shared_tokens]
    own = [text[: args.own_tokens] for text in texts[64:] if len(text) >= args.own_tokens]
    if len(shared) < args.shared_tokens or len(own) < args.batch_size * args.rounds:
        parser.error("the evaluation prompts are too short for --shared-tokens / --own-tokens")
    # one seed for all: a family whose prompt KV depends on the request's seed (Huginn's random initial state) shares
    # prompt blocks only between requests of the same seed
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True, seed=args.seed)
    rng = random.Random(args.seed)
    rounds, identical = [], True
    for r in range(args.rounds):
        prompts = [shared + q for q in own[r * args.batch_size : (r + 1) * args.batch_size]]
        order = list(ENGINES)
        rng.shuffle(order)
        seconds, ttft, tokens = {}, {}, {}
        for name in order:
            start = time.perf_counter()
            outs = engines[name].generate(prompts, params)
            seconds[name] = time.perf_counter() - start
            ttft[name] = statistics.median(time_to_first_token(o) for o in outs)
            tokens[name] = [o.token_ids for o in outs]
        identical = identical and tokens["cached"] == tokens["plain"] == tokens["plain-B"]
        if r:
            rounds.append((seconds, ttft))
    stats = engines["cached"].stats
    for engine in engines.values():
        engine.close()

    def ratios(index: int, other: str) -> tuple[float, float, float]:
        values = [rd[index]["plain"] / rd[index][other] for rd in rounds]
        return statistics.median(values), min(values), max(values)

    result = {
        "args": vars(args),
        "throughput": {name: ratios(0, name) for name in ("plain-B", "cached")},
        "time_to_first_token": {name: ratios(1, name) for name in ("plain-B", "cached")},
        "cached_prompt_tokens": [stats.num_prefix_cache_hits, stats.num_prefix_cache_queries],
        "outputs_identical": identical,
    }
    print(f"{args.model}, B={args.batch_size}, {args.shared_tokens} shared + {args.own_tokens} own prompt tokens, "
          f"{args.max_tokens} new, speculation {args.speculation}, {len(rounds)} rounds kept")  # fmt: skip
    for label, key in (("throughput (wall time)", "throughput"), ("time to first token", "time_to_first_token")):
        for name, (median, low, high) in result[key].items():
            line = "A/A  " if name == "plain-B" else "cache"
            print(f"  {label:<24} {line} plain ÷ {name:<8} {median:.2f}x [{low:.2f}-{high:.2f}]")
    hits, queries = result["cached_prompt_tokens"]
    print(f"  prompt tokens from the cache: {hits}/{queries}; outputs identical: {identical}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
