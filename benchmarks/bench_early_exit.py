"""Early exit: full depth vs a tau sweep in both modes (vs adaptive speculation at full depth), with its cost.

Speed is never shown without quality: for each configuration, besides decode tokens/s and the ratio to
plain full-depth decoding, it prints the mean loops per token, the agreement of the committed tokens with
full-depth greedy (position by position, and the matching prefix) and the per-token NLL of the committed
tokens under the full-depth model (dense forward), on held-out text prompts.

    python benchmarks/bench_early_exit.py --model tiny-ouro --batch-sizes 1,8 --max-tokens 32 --taus 0.5,0.7,0.9
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from common import Bench, prompt_set

from looped_spec import SamplingParams


def timed_generate(engine, prompts, params: SamplingParams, repeats: int) -> tuple[float, list[list[int]], dict]:
    """Decode tokens/s (wall minus prefill, median of `repeats`), outputs, and the last run's engine stats."""
    engine.generate(prompts, params.model_copy(update={"max_tokens": 4}))  # warm-up at the batch shape
    times, outputs = [], None
    for _ in range(repeats):
        prefill0 = engine.stats.phase_seconds["prefill"]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        times.append(time.perf_counter() - start - (engine.stats.phase_seconds["prefill"] - prefill0))
    decoded = sum(len(o.token_ids) for o in outputs) - len(prompts)
    return decoded / statistics.median(times), [o.token_ids for o in outputs], engine.stats


@torch.inference_mode()
def nll_under_full_depth(adapter, engine, prompts, outputs) -> float:
    """Mean NLL (nats/token) of the committed tokens under the full-depth model, cache-free."""
    total, count = 0.0, 0
    for prompt, out in zip(prompts, outputs):
        ids = list(prompt if isinstance(prompt, list) else engine.tokenizer.encode(prompt)) + out
        logits = adapter.dense_logits(torch.tensor(ids))[0, len(ids) - len(out) - 1 : -1]
        total += float(F.cross_entropy(logits, torch.tensor(out), reduction="sum"))
        count += len(out)
    return total / count


def agreement(outputs, reference) -> tuple[float, float]:
    """(fraction of positions equal to full-depth greedy, mean matching-prefix fraction)."""
    same = sum(a == b for out, ref in zip(outputs, reference) for a, b in zip(out, ref))
    total = sum(len(ref) for ref in reference)
    prefixes = []
    for out, ref in zip(outputs, reference):
        n = next((i for i, (a, b) in enumerate(zip(out, ref)) if a != b), min(len(out), len(ref)))
        prefixes.append(n / len(ref))
    return same / total, sum(prefixes) / len(prefixes)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--taus", default="0.5,0.7,0.9", help="exit thresholds (Ouro: cumulative probability)")
    parser.add_argument("--exit-at-steps", default="", help="also fixed depths, e.g. 2,3")
    parser.add_argument("--prompts", default="heldout", choices=["random", "humaneval", "heldout", "mixed"])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args.model)
    adapter = bench.adapter
    depth = adapter.full_depth
    rules = [("tau", float(t)) for t in args.taus.split(",") if t] + [
        ("k", int(k)) for k in args.exit_at_steps.split(",") if k
    ]
    print(f"model {adapter.name} D={depth}  max_tokens={args.max_tokens}  prompts={args.prompts}")
    header = f"{'batch':>5} {'configuration':<26} {'tok/s':>8} {'x plain':>8} {'loops/tok':>9} {'agree':>6} "
    print(header + f"{'prefix':>6} {'NLL':>7}")
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts = prompt_set(args.prompts, batch, adapter)
        greedy = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        plain_tps, reference, _ = timed_generate(bench.engine("off"), prompts, greedy, args.repeats)

        engine = bench.engine("off")
        rows = [("full depth (plain)", plain_tps, reference, depth, engine)]
        engine = bench.engine("adaptive")
        tps, outputs, _ = timed_generate(engine, prompts, greedy, args.repeats)
        rows.append(("full depth + adaptive spec", tps, outputs, depth, engine))
        for mode in ("skip", "select"):
            for kind, value in rules:
                params = greedy.model_copy(update={"exit_threshold" if kind == "tau" else "exit_at_step": value})
                engine = bench.engine("off", early_exit=mode)
                tps, outputs, stats = timed_generate(engine, prompts, params, args.repeats)
                rows.append((f"{mode} {kind}={value}", tps, outputs, stats.mean_loops_per_token, engine))
        for name, tps, outputs, loops, engine in rows:
            agree, prefix = agreement(outputs, reference)
            nll = nll_under_full_depth(adapter, engine, prompts, outputs)
            print(
                f"{batch:>5} {name:<26} {tps:>8.1f} {tps / plain_tps:>7.2f}x {loops:>9.2f} {agree:>6.1%} "
                f"{prefix:>6.1%} {nll:>7.3f}"
            )


if __name__ == "__main__":
    main()
