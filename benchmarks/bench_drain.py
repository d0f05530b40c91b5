"""The drain pricing (docs/adaptive.md "Draining") checked against fixed plans draining a static batch.

For every plan (`--plans`, plain included) one persistent engine with that fixed (K, d) decodes the same B
evaluation prompts (`--max-tokens` new tokens each, greedy, eos ignored), the plans interleaved in an order
shuffled per repeat, the first repeat discarded. The engines' controller traces give every decode round's
batch size, mean context and seconds (draft + full depth + commit). Per plan, medians over the repeats of:

- fill: the mean share of the batch still decoding in a round;
- measured ÷ lockstep: the decode seconds against the same tokens committed in full-batch rounds, at the
  median measured cost of this plan's full-batch rounds (the per-round price's assumption);
- occupancy ÷ lockstep: the rounds as they ran (their batch sizes and contexts) priced by the preset's cost
  profile, scaled to that same full-batch median — what the drain costs if the profile's cost(n) is right;
- model ÷ lockstep: what `control/drain.py` predicts, at the agreement α whose chain expectation gives the
  plan's measured tokens per request-round at full batch, with the preset's spread σ and persistence ρ;
- and the plan's decode seconds against plain decoding's (median over the repeats of the per-repeat ratio).

model ÷ occupancy is the drain model's error in the batch's occupancy; measured ÷ occupancy the profile's error
in how a round's cost falls with its batch. A model the policy can trust has both near 1.

    python benchmarks/bench_drain.py --model tiny-ouro --batch-size 8 --plans "0,0;1,1;1,2;2,1;2,2" --repeats 8
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig, load_adapter
from looped_spec.control.acceptance import markov_tokens
from looped_spec.control.costprofile import CostProfile
from looped_spec.control.drain import drain_seconds, request_rates, slices
from looped_spec.control.presets import PresetError, load_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import PROMPT_KINDS, load_prompts, parse_grid  # noqa: E402


def chain_alpha(tokens: float, rho: float, k: int) -> float:
    """The agreement α whose chain expectation `markov_tokens(α, ρ, K)` is `tokens` (bisection)."""
    lo, hi = 0.0, 1.0
    for _ in range(50):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if markov_tokens(mid, rho, k) < tokens else (lo, mid)
    return (lo + hi) / 2


def rounds_of(trace: Path) -> list[dict[str, Any]]:
    """Decode rounds of a controller trace, in order: batch, context, seconds, tokens committed."""
    plans, out = {}, []
    for line in trace.read_text(encoding="utf-8").splitlines():
        event = json.loads(line)
        if event["event"] == "plan":
            plans[event["plan_id"]] = event
        elif event["event"] == "feedback":
            plan = plans.pop(event["plan_id"])
            seconds = event["draft_time"] + event["full_depth_time"] + event["commit_time"]
            tokens = sum(event["num_accepted"]) + len(event["num_accepted"])
            out.append({"batch": plan["batch"], "context": plan["context"], "seconds": seconds, "tokens": tokens})
    return out


def check_run(rounds: list[dict[str, Any]], k: int, d: int, batch: int, budget: int, profile: CostProfile, acc):
    """(fill, tokens per request-round at full batch, measured / occupancy / model seconds ÷ lockstep)."""
    full = [r for r in rounds if r["batch"] == batch]
    scale = statistics.median(r["seconds"] / profile.predict(k, d, batch, r["context"]) for r in full)
    rate = sum(r["tokens"] for r in full) / (batch * len(full))
    tokens = sum(r["tokens"] for r in rounds)
    context = statistics.mean(r["context"] for r in rounds)
    full_round = scale * profile.predict(k, d, batch, context)
    lockstep = tokens / (batch * rate) * full_round
    measured = sum(r["seconds"] for r in rounds)
    occupancy = sum(scale * profile.predict(k, d, r["batch"], r["context"]) for r in rounds)
    cost = np.array([0.0] + [scale * profile.predict(k, d, n, context) for n in range(1, batch + 1)])
    if k > 0:
        alpha = chain_alpha(rate, acc.rho[d - 1], k)
        speeds = request_rates(alpha, acc.spread[d - 1], acc.rho[d - 1], k, slices(batch))
    else:
        speeds = np.ones(1)
    model = drain_seconds([budget] * batch, speeds, cost) / (budget / rate * full_round)
    fill = sum(r["batch"] for r in rounds) / (batch * len(rounds))
    return fill, rate, measured / lockstep, occupancy / lockstep, model, measured


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped name")
    parser.add_argument("--preset", default=None, help="preset with a cost profile and acceptance spread")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--plans", default="0,0;1,1;1,2;2,1;2,2", help='"K,d;K,d" (0,0: plain decoding)')
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="eval", choices=PROMPT_KINDS)
    parser.add_argument("--repeats", type=int, default=8, help="repeats; the first is discarded")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0 = torch default)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeats < 2:
        parser.error("--repeats must be >= 2 (the first is a discarded warm-up)")
    if args.batch_size < 2 or args.max_tokens < 3:
        parser.error("--batch-size must be >= 2 and --max-tokens >= 3 (a batch that can drain)")
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_adapter(args.model)
    entries = [p.strip() for p in args.plans.split(";")]
    plain = "0,0" in entries
    try:
        plans = ([(0, 0)] if plain else []) + parse_grid(";".join(e for e in entries if e != "0,0"), adapter.full_depth)
    except ValueError as exc:
        parser.error(str(exc).replace("--grid", "--plans"))
    if not plans:
        parser.error("--plans: no plan to check")
    try:
        config = load_preset(adapter.name, adapter.full_depth, args.preset, folder=adapter.path)
    except (OSError, ValueError, PresetError) as exc:
        parser.error(f"--preset: {exc}")
    if config.cost is None or config.acceptance is None or config.acceptance.spread is None:
        parser.error(f"preset of {adapter.name} has no cost profile or acceptance spread: nothing to check")
    profile = CostProfile(config.full_depth, **config.cost.model_dump())
    prompts, described = load_prompts(args.prompts, args.batch_size, adapter, args.seed)
    prompts = prompts[: args.batch_size]
    with tempfile.TemporaryDirectory() as tmp:
        engines, traces, marks = {}, {}, {kd: [] for kd in plans}
        for kd in plans:
            traces[kd] = Path(tmp) / f"{kd[0]}_{kd[1]}.jsonl"
            spec = SpeculativeConfig(k=kd[0], d=kd[1]) if kd[0] else "off"
            engines[kd] = LoopedSpecEngine(
                adapter, speculation=spec, max_batch_size=args.batch_size, trace_path=traces[kd]
            )
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        rng = random.Random(args.seed)
        for _ in range(args.repeats):
            order = list(plans)
            rng.shuffle(order)
            for kd in order:
                start = engines[kd].stats.num_rounds
                engines[kd].generate(prompts, params)
                marks[kd].append((start, engines[kd].stats.num_rounds))
        for engine in engines.values():
            engine.close()
        rounds = {kd: rounds_of(traces[kd]) for kd in plans}
    print(
        f"model {adapter.name}, B = {args.batch_size}, {args.max_tokens} tokens, prompts {described}; "
        f"{args.repeats} repeats, the first discarded; medians over repeats"
    )
    print(
        f"  {'plan':<6} {'fill':>5} {'tok/round':>9} {'meas/lock':>9} {'occ/lock':>8} {'model/lock':>10} "
        f"{'model/occ':>9} {'meas/occ':>8} {'÷ plain':>8}"
    )
    result: dict[str, Any] = {"model": adapter.name, "batch_size": args.batch_size, "plans": {}}
    seconds = {}
    for kd in plans:
        k, d = kd[0], kd[1] if kd[0] else 0
        runs = [
            check_run(rounds[kd][a:b], k, d, args.batch_size, args.max_tokens - 1, profile, config.acceptance)
            for a, b in marks[kd][1:]
        ]
        seconds[kd] = [r[5] for r in runs]
        cols = [statistics.median(r[i] for r in runs) for i in range(5)]
        model_occ = statistics.median(r[4] / r[3] for r in runs)
        meas_occ = statistics.median(r[2] / r[3] for r in runs)
        result["plans"][f"{kd[0]},{kd[1]}"] = {
            "fill": cols[0],
            "tokens_per_round": cols[1],
            "measured_vs_lockstep": cols[2],
            "occupancy_vs_lockstep": cols[3],
            "model_vs_lockstep": cols[4],
            "model_vs_occupancy": model_occ,
            "measured_vs_occupancy": meas_occ,
        }
    for kd in plans:
        entry = result["plans"][f"{kd[0]},{kd[1]}"]
        vs_plain = "-"
        if plain:
            entry["vs_plain"] = statistics.median(p / s for p, s in zip(seconds[(0, 0)], seconds[kd]))
            vs_plain = f"{entry['vs_plain']:.3f}x"
        print(
            f"  {kd[0]},{kd[1]:<4} {entry['fill']:>5.2f} {entry['tokens_per_round']:>9.2f} "
            f"{entry['measured_vs_lockstep']:>9.3f} {entry['occupancy_vs_lockstep']:>8.3f} "
            f"{entry['model_vs_lockstep']:>10.3f} {entry['model_vs_occupancy']:>9.3f} "
            f"{entry['measured_vs_occupancy']:>8.3f} {vs_plain:>8}"
        )
    return result


if __name__ == "__main__":
    main()
