"""What the adaptive engine costs over plain decoding, and how much of it is counterfactual readouts.

Engines, one persistent each, interleaved in turns of `--slice-ms` (bench_speculative.py's `timed_slices`), on
prompts that rotate round by round (round n from offset 7n of the set): plain, plain-B (the A/A control),
`adaptive` (the default engine), `adaptive few-readouts` (readout budget a tenth of the default's) and `adaptive
no-readouts` (a budget so small that only the first round reads out: acceptance stays near the preset's prior, so
this engine's plans need not be the default's; it bounds what readouts cost, not what adaptive would do without
them). Printed per engine: the median ratio to plain over the measured rounds with the standard error of that
median (1.25 sd / sqrt(n) of the per-round log-ratios), the controller's microseconds per round, and the plans it
ran. Used for docs/adaptive.md "Tunables" (the readout budget). As bench_speculative.py does, it exits with status 2
when the model's preset records among its tuning prompts (provenance["prompts"]["fingerprints"]) any prompt the
engines would decode (`--prompts tune`).

    python benchmarks/bench_overhead.py --model tiny-nanbeige --batch-size 1 --rounds 80 --threads 1
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from pathlib import Path

import torch

from looped_spec import LoopedSpecEngine
from looped_spec.control.settings import ControlSettings
from looped_spec.tuning.grid import prompt_source_flag
from looped_spec.tuning.prompt_sets import PromptSetError, load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import PromptPool, rotation_size, timed_slices  # noqa: E402
from common import check_model, check_prompt_source, load_model, refuse_tuning_prompts  # noqa: E402


def adaptive_engine(adapter, readouts: str, **options) -> LoopedSpecEngine:
    """The default adaptive engine with readouts as asked: "default", "few" (a tenth of the budget) or "none"; `options`
    are the engine's others."""
    budget = {"default": ControlSettings.readout_budget, "few": ControlSettings.readout_budget / 10, "none": 1e-9}
    return LoopedSpecEngine(adapter, speculation="adaptive", control={"readout_budget": budget[readouts]}, **options)


def main(argv: list[str] | None = None) -> dict[str, tuple[float, float]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--prompts", default="eval", type=prompt_source_flag)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=40, help="rounds; the first is discarded")
    parser.add_argument("--slice-ms", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.rounds < 3 or args.batch_size < 1 or args.max_tokens < 2 or not args.slice_ms > 0.0 or args.threads < 0:
        parser.error("need --rounds >= 3, --batch-size >= 1, --max-tokens >= 2, --slice-ms > 0 and --threads >= 0")
    try:  # before the model loads
        check_model(args.model)
        check_prompt_source(args.prompts)
    except ValueError as exc:
        parser.error(str(exc))
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_model(parser, args.model)
    count = rotation_size(args.prompts, args.batch_size)
    try:
        prompts, described = load_prompts(args.prompts, count, adapter, seed=args.seed)
    except PromptSetError as exc:  # e.g. a file's text for a model without a tokenizer
        parser.error(str(exc))
    pool = PromptPool(prompts, rotate=True)
    # the whole batch at once: with the engine's default max_batch_size (32) a larger one would decode in waves
    batch = {"max_batch_size": args.batch_size}
    engines = {name: LoopedSpecEngine(adapter, speculation="off", **batch) for name in ("plain", "plain-B")}
    for readouts in ("default", "few", "none"):
        name = {"default": "adaptive", "few": "adaptive few-readouts", "none": "adaptive no-readouts"}[readouts]
        engines[name] = adaptive_engine(adapter, readouts, **batch)
    # the three adaptive engines follow the model's one preset: refuse to time it on its own tuning prompts
    refuse_tuning_prompts("the adaptive engines", engines["adaptive"].controller.config, prompts)
    rotating = f"{described} (rotating), {args.max_tokens} new tokens, {args.rounds} rounds"
    print(f"{adapter.name}, B={args.batch_size}, {rotating}")
    rng = random.Random(args.seed)
    rounds = []
    for _ in range(args.rounds):
        done = timed_slices(engines, pool.slice(0, args.batch_size), args.max_tokens, args.slice_ms / 1000.0, rng)
        pool.next_round()
        rounds.append({name: record for name, (record, _) in done.items()})
    measured = rounds[1:]
    results = {}
    for name in engines:
        if name == "plain":
            continue
        logs = [math.log(rd["plain"]["decode_s"] / rd[name]["decode_s"]) for rd in measured]
        se = 1.25 * statistics.pstdev(logs) / math.sqrt(len(logs))
        results[name] = (math.exp(statistics.median(logs)), se)
        control_us = statistics.median(rd[name]["control_s"] / max(rd[name]["rounds"], 1) for rd in measured) * 1e6
        plans: dict[str, int] = {}
        for rd in measured:
            for plan, count in rd[name]["plans"].items():
                plans[plan] = plans.get(plan, 0) + count
        top = ", ".join(f"{p}: {c}" for p, c in sorted(plans.items(), key=lambda kv: -kv[1])[:3])
        print(f"{name:26} {results[name][0]:.3f}x ±{se:.3f} (se)  control {control_us:.0f} µs/round  plans {top}")
    return results


if __name__ == "__main__":
    main()
