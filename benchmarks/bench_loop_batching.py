"""Loop-level batching vs the step engine, side by side in one process (docs/benchmarking.md "Loop-level batching").

Three persistent engines — `step`, a second `step-B` (the A/A control) and `loop` (batching="loop"), all with
speculation off, all with one fixed plan (`--speculation K,d`) or all adaptive, each its own controller
(`--speculation adaptive`) — decode the same rotating prompts in turns of
`--slice-ms` (order shuffled every turn), for every early-exit mode asked (`full`: every token at depth D; `tau0.7`:
the family rule at threshold 0.7; `step2`: exit_at_step=2; ...). Per mode: the median over rounds (the first
discarded) of step ÷ loop time to serve the batch, prompts included (loop passes run prompt chunks together with
decoding, so their prefill cannot be told apart), with the standard error of that median (1.25 sd / sqrt(n)
of the log-ratios), the A/A line beside it, the loops per token, and the loop engine's passes per token and
positions per pass (occupancy) against the step engine's loop calls per token, so the ratio can be read against the
pass counts (with speculation, per committed token), and each engine's host time per token (its time outside the
adapter's stages: scheduling, bookkeeping, index building, sampling). Greedy outputs of the three engines are
checked equal.

    python benchmarks/bench_loop_batching.py --model tiny-ouro --batch-size 8 --modes full,tau0.7,tau0.9,step2
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
from looped_spec.tuning.grid import prompt_source_flag
from looped_spec.tuning.prompt_sets import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import PromptPool, rotation_size  # noqa: E402


def mode_params(mode: str, count: int, max_tokens: int) -> list[SamplingParams]:
    """`full`, `tauX` (exit_threshold X) or `stepN` (exit_at_step N) for `count` requests, greedy, eos ignored."""
    extra: dict = {}
    if mode.startswith("tau"):
        extra = {"exit_threshold": float(mode[3:])}
    elif mode.startswith("step"):
        extra = {"exit_at_step": int(mode[4:])}
    elif mode != "full":
        raise SystemExit(f"--modes: unknown mode {mode!r} (full, tauX, stepN)")
    return [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i, **extra) for i in range(count)]


class AdapterCalls:
    """Counts the adapter's loop calls (one per loop pass; a step engine calls it once per loop of a step) and times
    every call of its stages (embed, loop, exit rule, readout): the engines' model time; the rest of their time is
    host work (scheduling, bookkeeping, index building, sampling)."""

    STAGES = ("embed", "loop", "exit_rule", "readout")

    def __init__(self, adapter) -> None:
        self.calls, self.seconds, self._open = 0, 0.0, 0
        for stage in self.STAGES:
            setattr(adapter, stage, self._timed(stage, getattr(adapter, stage)))

    def _timed(self, stage: str, original):
        def call(*args, **kwargs):
            if stage == "loop":
                self.calls += 1
            self._open += 1  # a stage calling another (Huginn's KL rule reads out) is timed once, as the outer one
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self._open -= 1
                if not self._open:
                    self.seconds += time.perf_counter() - start

        return call


def counters(engine: LoopedSpecEngine) -> dict:
    s = engine.stats
    return {
        "passes": s.num_loop_passes,
        "positions": s.num_loop_pass_positions,
        "loops_run": s.num_exit_loops_run,
        "exit_tokens": sum(s.exit_depth_histogram.values()),
    }


def timed_turns(engines, prompts, params, slice_s: float, rng: random.Random, calls: AdapterCalls) -> dict:
    """Every engine decodes `prompts` with `params`, the engines taking turns of at least `slice_s` seconds."""
    before = {name: counters(e) for name, e in engines.items()}
    wall, ids, done, loop_calls, model = {}, {}, {}, dict.fromkeys(engines, 0), dict.fromkeys(engines, 0.0)
    for name, engine in engines.items():
        start = time.perf_counter()
        ids[name] = [engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        wall[name], done[name] = time.perf_counter() - start, {}
    active = list(engines)
    while active:
        rng.shuffle(active)
        for name in active:
            engine, finished = engines[name], done[name]
            start = now = time.perf_counter()
            calls_before, model_before = calls.calls, calls.seconds
            while len(finished) < len(ids[name]) and now - start < slice_s:
                for out in engine.step():
                    if out.finished:
                        finished[out.request_id] = out
                now = time.perf_counter()
            wall[name] += now - start
            loop_calls[name] += calls.calls - calls_before
            model[name] += calls.seconds - model_before
        active = [n for n in active if len(done[n]) < len(ids[n])]
    out = {}
    for name, engine in engines.items():
        after, b = counters(engine), before[name]
        outputs = [done[name][i].token_ids for i in ids[name]]
        tokens = sum(len(o) for o in outputs) - len(outputs)  # the first token of each comes from prefill
        out[name] = {
            "seconds": wall[name],  # prompts and tokens: the loop engine runs prompt chunks in its passes
            "tokens": tokens,
            "loop_calls": loop_calls[name],
            "model_seconds": model[name],  # inside the adapter's stages; prompts' included (added before the turns)
            "passes": after["passes"] - b["passes"],
            "positions": after["positions"] - b["positions"],
            "loops_run": after["loops_run"] - b["loops_run"],
            "exit_tokens": after["exit_tokens"] - b["exit_tokens"],
            "outputs": outputs,
        }
    return out


def ratio(rounds: list[dict], a: str, b: str) -> tuple[float, float]:
    """The median over rounds of time(a) ÷ time(b) (above 1: b is faster), with its standard error."""
    logs = [math.log(r[a]["seconds"] / r[b]["seconds"]) for r in rounds]
    return math.exp(statistics.median(logs)), 1.25 * statistics.pstdev(logs) / math.sqrt(len(logs))


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro")
    parser.add_argument("--adapter-option", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--prompts", default="eval", type=prompt_source_flag)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--modes", default="full,tau0.7")
    parser.add_argument("--early-exit", default="skip", choices=["skip", "select"])
    parser.add_argument("--speculation", default="off", help="off, a fixed plan K,d or adaptive (every engine)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=12, help="rounds per mode; the first is discarded")
    parser.add_argument("--slice-ms", type=float, default=20.0)
    parser.add_argument("--threads", type=int, default=1, help="0: torch's default")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=None, help="write the rounds and the table as JSON here")
    args = parser.parse_args(argv)
    if args.rounds < 3 or args.batch_size < 1 or args.max_tokens < 2:
        parser.error("need --rounds >= 3, --batch-size >= 1, --max-tokens >= 2")
    if args.threads:
        torch.set_num_threads(args.threads)
    from looped_spec.tuning.inputs import parse_adapter_options

    adapter = load_adapter(args.model, **(parse_adapter_options(args.adapter_option) or {}))
    calls = AdapterCalls(adapter)
    prompts, described = load_prompts(
        args.prompts, rotation_size(args.prompts, args.batch_size), adapter, seed=args.seed
    )
    pool = PromptPool(prompts, rotate=True)
    options = dict(speculation=args.speculation, early_exit=args.early_exit, max_batch_size=max(args.batch_size, 1))
    engines = {
        "step": LoopedSpecEngine(adapter, **options),
        "step-B": LoopedSpecEngine(adapter, **options),
        "loop": LoopedSpecEngine(adapter, batching="loop", **options),
    }
    print(f"{adapter.name} (D={adapter.full_depth}), B={args.batch_size}, {described} (rotating), "
          f"{args.max_tokens} new tokens, {args.early_exit} mode, speculation {args.speculation}, "
          f"threads {torch.get_num_threads()}")  # fmt: skip
    print(f"{'mode':8} {'loop vs step':>16} {'A/A (step-B)':>16} {'loops/token':>12} {'passes/token':>13} "
          f"{'positions/pass':>15} {'step loop calls/token':>22} {'host us/token step, loop':>25}")  # fmt: skip
    rng = random.Random(args.seed)
    table, raw = {}, {}
    for mode in args.modes.split(","):
        rounds = []
        for _ in range(args.rounds):
            batch = pool.slice(0, args.batch_size)
            params = mode_params(mode, len(batch), args.max_tokens)
            done = timed_turns(engines, batch, params, args.slice_ms / 1000.0, rng, calls)
            pool.next_round()
            if not done["step"]["outputs"] == done["loop"]["outputs"] == done["step-B"]["outputs"]:
                raise SystemExit(f"{mode}: the loop engine's greedy output differs from the step engine's")
            rounds.append(done)
        measured = rounds[1:]
        speed, se = ratio(measured, "step", "loop")
        aa, aa_se = ratio(measured, "step", "step-B")
        tokens = sum(r["loop"]["tokens"] for r in measured)
        exit_tokens = sum(r["loop"]["exit_tokens"] for r in measured)
        loops = sum(r["loop"]["loops_run"] for r in measured) / exit_tokens if exit_tokens else adapter.full_depth
        passes = sum(r["loop"]["passes"] for r in measured)
        positions = sum(r["loop"]["positions"] for r in measured)
        row = {
            "loop_vs_step": speed, "se": se, "aa": aa, "aa_se": aa_se, "loops_per_token": loops,
            "passes_per_token": passes / tokens, "positions_per_pass": positions / passes,
            "step_loop_calls_per_token": sum(r["step"]["loop_calls"] for r in measured) / tokens,
            # time outside the adapter's stages per generated token (median over rounds), step and loop engine
            "host_us_per_token": {
                name: 1e6 * statistics.median((r[name]["seconds"] - r[name]["model_seconds"]) / r[name]["tokens"]
                                              for r in measured)
                for name in ("step", "loop")
            },
        }  # fmt: skip
        table[mode] = row
        raw[mode] = [{n: {k: v for k, v in rec.items() if k != "outputs"} for n, rec in r.items()} for r in rounds]
        print(f"{mode:8} {speed:>10.3f}x ±{se:.3f} {aa:>10.3f}x ±{aa_se:.3f} {loops:>12.2f} "
              f"{row['passes_per_token']:>13.3f} {row['positions_per_pass']:>15.2f} "
              f"{row['step_loop_calls_per_token']:>22.3f} "
              f"{row['host_us_per_token']['step']:>13.1f}, {row['host_us_per_token']['loop']:.1f}")  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), "table": table, "rounds": raw}, indent=1))
    return table


if __name__ == "__main__":
    main()
