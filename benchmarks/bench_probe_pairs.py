"""Do plain probes price a plan like its steady rounds? (control/probes.py, docs/adaptive.md "Quiet rounds")

The goodput policy's probes run one plain round in place of a plan's round and compare it with the plan's next
round. If a speculative round right after a plain one were slower (or faster) than one after its own kind
(caches, memoized tables, allocator state), the probes would misprice every plan by that much. This script
measures it: per plan (`--plans`) one persistent engine runs that fixed (K, d) every round but plain decoding
every `--every`-th round (as a probe would), the plans and a plain engine interleaved in an order shuffled per
repeat, the first repeat (`--max-tokens 8`) discarded. Over the full-batch rounds (every request still
decoding) it prints, per plan:

- after plain ÷ steady: the median seconds of the plan's rounds right after a plain round against those of its
  rounds three or more after one;
- probe ÷ plain engine: the median of the inserted plain rounds against the plain engine's rounds;
- pair ratio (the probes' measurement: plan round after plain ÷ that plain round), steady ratio (the plan's
  steady round ÷ the plain engine's round) and their quotient: the probes' bias (1.0 = none);
- the preset's cost profile's ratio for the plan at this batch size (what the policy prices without probes).

    python benchmarks/bench_probe_pairs.py --model tiny-nanbeige --batch-size 32 --plans "1,1;2,1;3,1" --repeats 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from pathlib import Path
from typing import Any

import torch

from looped_spec import LoopedSpecEngine, load_adapter
from looped_spec.control.controller import FixedController
from looped_spec.control.costprofile import CostProfile
from looped_spec.control.plan import RoundFeedback, SpeculationPlan
from looped_spec.control.presets import load_preset

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import load_prompts, timed_generate  # noqa: E402


class PlainEvery(FixedController):
    """(K, d) every round but plain decoding every `every`-th; logs (k, batch, seconds, rounds since plain)."""

    name = "plain-every"

    def __init__(self, k: int, d: int, depth: int, every: int) -> None:
        super().__init__(k, d, depth)
        self.every = every
        self.rounds = 0
        self.log: list[tuple[int, int, float, int]] = []

    def plan(self, num_running: int, context: float | None = None, remaining=None) -> SpeculationPlan:
        self.rounds += 1
        k = 0 if self.rounds % self.every == 0 else self.k
        plan = SpeculationPlan(self._next_id, k, self.d if k else 0)
        self._next_id += 1
        self.num_plans += 1
        return plan

    def observe(self, feedback: RoundFeedback) -> None:
        self.log.append((feedback.k, feedback.batch_size, feedback.round_time, self.rounds % self.every))
        super().observe(feedback)


def parse_plans(text: str) -> list[tuple[int, int]]:
    plans = []
    for item in text.split(";"):
        k, d = (int(x) for x in item.split(","))
        if k < 1 or d < 1:
            raise argparse.ArgumentTypeError(f"--plans: {item!r} is not a speculative (K, d) with K, d >= 1")
        plans.append((k, d))
    return plans


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-nanbeige")
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--plans", type=parse_plans, default=parse_plans("1,1;2,1"))
    parser.add_argument("--every", type=int, default=8, help="a plain round every this many rounds (>= 4)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompts", default="eval")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=3)
    args = parser.parse_args(argv)
    if args.every < 4:
        parser.error("--every must be >= 4 (a plan needs rounds three or more after a plain one)")
    if args.repeats < 1 or args.batch_size < 1 or args.max_tokens < 2:
        parser.error("--repeats and --batch-size must be >= 1, --max-tokens >= 2")
    torch.set_num_threads(args.threads)
    adapter = load_adapter(args.model)
    prompts, described = load_prompts(args.prompts, args.batch_size, adapter, 0)
    depth = adapter.full_depth
    for _, d in args.plans:
        if d >= depth:
            parser.error(f"--plans: d={d} must be < the model's full depth {depth}")
    config = load_preset(adapter.name, depth, None, folder=adapter.path, config=adapter.config)
    profile = CostProfile(depth, **config.cost.model_dump()) if config.cost is not None else None

    engines: dict[str, LoopedSpecEngine] = {}
    for k, d in args.plans:
        engine = LoopedSpecEngine(adapter, speculation=f"{k},{d}", max_batch_size=max(64, args.batch_size))
        engine.controller = PlainEvery(k, d, depth, args.every)  # the engine plans through this from now on
        engines[f"{k},{d}"] = engine
    engines["plain"] = LoopedSpecEngine(adapter, speculation="off", max_batch_size=max(64, args.batch_size))
    plain_times: list[tuple[int, float]] = []
    plain_observe = engines["plain"].controller.observe

    def log_plain(feedback: RoundFeedback) -> None:
        plain_times.append((feedback.batch_size, feedback.round_time))
        plain_observe(feedback)

    engines["plain"].controller.observe = log_plain
    batch = prompts[: args.batch_size]
    for engine in engines.values():
        timed_generate(engine, batch, 8)  # warm-up, discarded
    for engine in engines.values():
        if isinstance(engine.controller, PlainEvery):
            engine.controller.log.clear()
    plain_times.clear()
    rng = random.Random(args.seed)
    names = list(engines)
    for _ in range(args.repeats):
        rng.shuffle(names)
        for name in names:
            timed_generate(engines[name], batch, args.max_tokens)

    full = args.batch_size
    plain_rounds = [t for b, t in plain_times if b == full]
    plain_s = statistics.median(plain_rounds)
    print(f"{adapter.name} B={full} ({described}), plain every {args.every}th round, {args.repeats} repeats")
    print(f"plain engine: {1e3 * plain_s:.2f} ms a full-batch round ({len(plain_rounds)} rounds)")
    report: dict[str, Any] = {"plain_seconds": plain_s, "plans": {}}
    for name, engine in engines.items():
        if name == "plain":
            continue
        k, d = engine.controller.k, engine.controller.d
        log = [entry for entry in engine.controller.log if entry[1] == full]
        probes = [t for kk, _, t, _ in log if kk == 0]
        after = [t for kk, _, t, pos in log if kk > 0 and pos == 1]
        steady = [t for kk, _, t, pos in log if kk > 0 and pos >= 3]
        if not (probes and after and steady):
            print(f"  ({k},{d}): too few full-batch rounds ({len(probes)} plain, {len(after)} after, {len(steady)})")
            continue
        pair = statistics.median(after) / statistics.median(probes)
        steady_ratio = statistics.median(steady) / plain_s
        profiled = profile.predict(k, d, full) / profile.predict(0, 0, full) if profile is not None else None
        row = {
            "after_plain_over_steady": statistics.median(after) / statistics.median(steady),
            "probe_over_plain_engine": statistics.median(probes) / plain_s,
            "pair_ratio": pair,
            "steady_ratio": steady_ratio,
            "probe_bias": pair / steady_ratio,
            "profile_ratio": profiled,
            "rounds": [len(after), len(steady), len(probes)],
        }
        report["plans"][name] = row
        prof = f"{profiled:.3f}" if profiled is not None else "-"
        print(
            f"  ({k},{d}): after plain ÷ steady {row['after_plain_over_steady']:.3f}, probe ÷ plain engine "
            f"{row['probe_over_plain_engine']:.3f}; pair ratio {pair:.3f}, steady ratio {steady_ratio:.3f}, "
            f"probe bias {row['probe_bias']:.3f}; profile's ratio {prof} "
            f"(rounds {len(after)}/{len(steady)}/{len(probes)})"
        )
    return report


if __name__ == "__main__":
    main()
