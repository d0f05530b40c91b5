"""Early exit: full depth vs a tau sweep in both modes (vs adaptive speculation at full depth), with its cost.

Speed is never shown without quality: for each configuration, besides decode tokens/s and the ratio to
plain full-depth decoding, it prints the mean loops run per token (over the timed runs; select mode runs
all D) and the mean readout depth, the agreement of the committed tokens with
full-depth greedy (position by position, and the matching prefix) and the per-token NLL of the committed
tokens under the full-depth model (dense forward), on the evaluation prompts (held out from training and
tuning; random token ids for a checkpoint without a tokenizer).

Thresholds are in the family rule's units (Ouro: cumulative exit probability; Huginn: KL between successive
steps, 5e-4 in its paper, or the latent change with --adapter-option exit_criterion=latent); a family without
an exit signal (Nanbeige) runs the fixed depths only.

    python benchmarks/bench_early_exit.py --model tiny-ouro --batch-sizes 1,8 --max-tokens 32 --taus 0.5,0.7,0.9
    python benchmarks/bench_early_exit.py --model tiny-huginn --taus 5e-4,1e-2 --exit-at-steps 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from bench_speculative import PROMPT_KINDS, load_prompts
from common import Bench

from looped_spec import SamplingParams
from looped_spec.tuner_inputs import parse_adapter_options


def timed_generate(engine, prompts, params: SamplingParams, repeats: int) -> tuple[float, list, float | None]:
    """Decode tokens/s (wall minus prefill, median of `repeats`), the last run's outputs, and the loops run per
    token read out by the early-exit path over the timed runs (None when no token was)."""
    engine.generate(prompts, params.model_copy(update={"max_tokens": 4}))  # warm-up at the batch shape
    stats = engine.stats
    tokens0, loops0 = sum(stats.exit_depth_histogram.values()), stats.num_exit_loops_run
    times, outputs = [], None
    for _ in range(repeats):
        prefill0 = stats.phase_seconds["prefill"]
        start = time.perf_counter()
        outputs = engine.generate(prompts, params)
        times.append(time.perf_counter() - start - (stats.phase_seconds["prefill"] - prefill0))
    decoded = sum(len(o.token_ids) for o in outputs) - len(prompts)
    exited = sum(stats.exit_depth_histogram.values()) - tokens0
    loops = (stats.num_exit_loops_run - loops0) / exited if exited else None
    return decoded / statistics.median(times), outputs, loops


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


def main(argv: list[str] | None = None) -> list[dict]:
    """Run the sweep, print the table; returns its rows."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--batch-sizes", default="1,8")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--taus", default="0.5,0.7,0.9", help="exit thresholds, in the family rule's units")
    parser.add_argument("--exit-at-steps", default="", help="also fixed depths, e.g. 2,3")
    parser.add_argument("--prompts", default="eval", choices=PROMPT_KINDS)
    parser.add_argument("--seed", type=int, default=0, help="random prompts' seed, and every request's seed")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (0 = torch default)")
    parser.add_argument("--adapter-option", action="append", metavar="KEY=VALUE", help="passed to the adapter")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bench = Bench(args.model, **parse_adapter_options(args.adapter_option))
    adapter = bench.adapter
    depth = adapter.full_depth
    rules = [("tau", float(t)) for t in args.taus.split(",") if t] + [
        ("k", int(k)) for k in args.exit_at_steps.split(",") if k
    ]
    if not adapter.has_exit_rule and any(kind == "tau" for kind, _ in rules):
        print(f"note: {adapter.model_type} has no exit signal; the thresholds are skipped (fixed depths only)")
        rules = [(kind, value) for kind, value in rules if kind != "tau"]
    print(f"model {adapter.name} D={depth}  max_tokens={args.max_tokens}  prompts={args.prompts}")
    header = f"{'batch':>5} {'configuration':<26} {'tok/s':>8} {'x plain':>8} {'loops/tok':>9} {'depth':>5} "
    print(header + f"{'agree':>6} {'prefix':>6} {'NLL':>7}")
    table = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        prompts, _ = load_prompts(args.prompts, batch, adapter, args.seed)
        greedy = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, seed=args.seed)
        plain_tps, reference, _ = timed_generate(bench.engine("off"), prompts, greedy, args.repeats)
        rows = [("full depth (plain)", plain_tps, reference, depth)]
        tps, outputs, _ = timed_generate(bench.engine("adaptive"), prompts, greedy, args.repeats)
        rows.append(("full depth + adaptive spec", tps, outputs, depth))
        for mode in ("skip", "select"):
            for kind, value in rules:
                params = greedy.model_copy(update={"exit_threshold" if kind == "tau" else "exit_at_step": value})
                tps, outputs, loops = timed_generate(bench.engine("off", early_exit=mode), prompts, params,
                                                     args.repeats)  # fmt: skip
                rows.append((f"{mode} {kind}={value}", tps, outputs, depth if loops is None else loops))
        ref_ids = [o.token_ids for o in reference]
        for name, tps, outputs, loops in rows:
            agree, prefix = agreement([o.token_ids for o in outputs], ref_ids)
            nll, readout = nll_under_full_depth(adapter, outputs), mean_readout_depth(outputs, depth)
            print(
                f"{batch:>5} {name:<26} {tps:>8.1f} {tps / plain_tps:>7.2f}x {loops:>9.2f} {readout:>5.2f} "
                f"{agree:>6.1%} {prefix:>6.1%} {nll:>7.3f}"
            )
            table.append(dict(batch=batch, configuration=name, tokens_per_s=tps, ratio=tps / plain_tps,
                              loops_per_token=loops, readout_depth=readout, agreement=agree, prefix=prefix,
                              nll=nll))  # fmt: skip
    return table


if __name__ == "__main__":
    main()
