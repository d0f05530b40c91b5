"""Adaptive speculation replayed on recorded text: acceptance exact, time from a profile (no timing involved).

It records each prompt's depth agreement along its greedy trajectory (`measure_match_bits`, deterministic) and drives
real controllers over static batches of B prompts that rotate as bench_speculative.py's rounds do (batch n from offset
7n), one persistent controller per configuration over all batches. Every round the controller plans; each request's
drafts accept the run of matching bits at the planned depth (cut to the tokens left, as the scheduler does); a
measured round reports every depth's bits on the committed positions; the round's seconds are the preset's profile
price of the plan at the batch size it had, times a log-normal noise (`--noise`, one run per `--seeds` seed), times
`--speculative-price` for a speculative round (a machine where speculation costs more next to plain than the
profile says: ~1.06 on this project's CPU for the shipped presets), and a measured round takes its readouts and
`--measure-overhead` of the round more (what a measured round costs beyond the profile's readouts: ~0.04 of a round
for the tiny models on this CPU, docs/adaptive.md "Which rounds read out"; replays before 2026-12-06's last used
0.12). `--price-table` (a table written by `plan_prices.py`) charges each plan instead its own measured price against
plain at the nearest batch size measured (a plan not in the table: the nearest one measured at that batch size, by
draft depth, then K): a machine whose relative prices of plans are not the profile's, as this one's are not (docs/
benchmarking.md, "Each plan's price on this machine"). Printed per batch size and configuration: tokens per priced
second ÷ plain's, the mean over seeds [min–max], the shares of speculative and of measured rounds, and the plans run
most.

`--prompts prose,code` switches the text every `--switch-every` batches, group after group, so that how soon a
setting follows a change of text shows too.

It separates what a controller setting does with what the text gives, which is deterministic here, from what the
machine's noise does to a timed run (bench_speculative.py): the controller's own profile prices the rounds, so only
its acceptance estimates (and the price, when set) can be wrong. A setting chosen here is then checked timed.
As bench_speculative.py does, it exits with status 2 when the preset records among its tuning prompts
(provenance["prompts"]["fingerprints"]) any prompt the controllers would be replayed on (`--prompts tune`).

    python benchmarks/replay_controller.py --model tiny-nanbeige --prompts eval --batch-sizes 1,8,32 \\
        --policies "default,default:prior_share=0.25" --grid "2,1;3,1"
"""

from __future__ import annotations

import argparse
import json
import math
import random
import re
import statistics
import sys
from pathlib import Path

import torch

from looped_spec.control import AdaptiveController, ControlSettings, FixedController
from looped_spec.control.buckets import compile_buckets
from looped_spec.control.passcost import PassCost
from looped_spec.control.plan import round_feedback
from looped_spec.presets.lookup import preset_for
from looped_spec.tuning.acceptance_pass import measure_match_bits
from looped_spec.tuning.grid import parse_batch_sizes, parse_grid, parse_prompt_source
from looped_spec.tuning.prompt_sets import PromptSetError, load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import ROTATION_STRIDE, adaptive_name, parse_policies, rotation_size  # noqa: E402
from common import (  # noqa: E402
    check_grid_entries,
    check_model,
    check_preset,
    check_prompt_source,
    load_model,
    refuse_tuning_prompts,
)


class Machine:
    """A round's seconds: the profile's price, a speculative round's times `speculative_price` (or its plan's price in
    `prices`, "K,d@B" -> measured ÷ profile against plain), a measured round's plus its readouts and
    `measure_overhead` of the round, times a log-normal noise of sd `noise`."""

    def __init__(
        self, cost: PassCost, noise: float, speculative_price: float, measure_overhead: float, seed: int,
        prices: dict[str, float] | None = None, switch_penalty: float = 0.0,
    ) -> None:  # fmt: skip
        self.cost, self.noise, self.rng = cost, noise, random.Random(seed)
        self.speculative_price, self.measure_overhead = speculative_price, measure_overhead
        # a plain round right after a speculative one takes this share of a plain round at B = 1 more (the caches
        # and predictors warm up again: docs/benchmarking.md, "A plain round after a speculative one")
        self.switch_seconds = switch_penalty * cost.seconds(0, 0, 1, 0.0)
        self.after_speculative = False
        self.table: dict[int, dict[tuple[int, int], float]] = {}  # batch size -> plan -> price
        for key, price in (prices or {}).items():
            plan, batch = key.split("@")
            k, d = (int(x) for x in plan.split(","))
            self.table.setdefault(int(batch), {})[k, d] = float(price)

    def price(self, k: int, d: int, batch: int) -> float:
        """A speculative round's price against plain: the table's at the nearest batch size it measured (in log), its
        plan or the nearest one measured there (by draft depth, then K); `speculative_price` without a table."""
        if not self.table:
            return self.speculative_price
        near = min(self.table, key=lambda b: (abs(math.log(b / max(batch, 1))), b))
        plans = self.table[near]
        return plans[min(plans, key=lambda p: (abs(p[1] - d), abs(p[0] - k), p))]

    def seconds(self, k: int, d: int, batch: int, context: float, measured: bool, read=None) -> float:
        """A round's seconds; a measured one reads out the depths `read` (None: the preset's draft depths)."""
        seconds = self.cost.seconds(k, d, batch, context) * (self.price(k, d, batch) if k else 1.0)
        if measured:
            seconds = seconds * (1.0 + self.measure_overhead) + self.cost.measure_seconds(k, d, batch, read)
        if not k and self.after_speculative:
            seconds += self.switch_seconds
        self.after_speculative = k > 0
        return seconds * math.exp(self.rng.gauss(0.0, self.noise))


def readouts(bits, prompts: list[int], starts: list[int], committed: list[int], read=None) -> dict:
    """A measured round's report: per depth the committed positions' bits, and per request its own counts; at the
    depths below full the controller reads out (`read`; None: every one), as the engine's runner reports them."""
    depth = len(bits)
    seen = [read is None or j + 1 in read or j + 1 == depth for j in range(depth)]
    spans = zip(prompts, starts, committed)
    own = [[sum(bits[j][p][start : start + n]) if seen[j] else 0 for j in range(depth)] for p, start, n in spans]
    return {
        "depth_matches": [sum(row[j] for row in own) for j in range(depth)],
        "depth_trials": [sum(committed) if seen[j] else 0 for j in range(depth)],
        "request_matches": own, "request_trials": list(committed),
    }  # fmt: skip


def drive(controller, bits, batches: list[list[int]], machine: Machine, context: float) -> dict[str, float]:
    """Every batch decoded to its end under `controller`; tokens, seconds and round counts."""
    out = {"tokens": 0, "seconds": 0.0, "rounds": 0, "speculative": 0, "measured": 0, "plans": {}}
    read = controller.readout_depths()  # the depths its measured rounds read out, as the engine's runner would
    for n, batch in enumerate(batches):
        prompt = {f"{n}.{i}": p for i, p in enumerate(batch)}  # every request its own id, as the engine's are
        position = dict.fromkeys(prompt, 0)  # committed tokens after the prefill's
        left = {i: len(bits[0][p]) for i, p in prompt.items()}
        while left:
            ids = list(left)
            plan = controller.plan(len(ids), context, ids)
            proposed, accepted = [], []
            for i in ids:
                k = min(plan.k, left[i] - 1)
                row, a = bits[plan.d - 1][prompt[i]] if k else (), 0
                while a < k and row[position[i] + a]:
                    a += 1
                proposed.append(k)
                accepted.append(a)
            report = {}
            if plan.measure_depths:
                prompts = [prompt[i] for i in ids]
                report = readouts(bits, prompts, [position[i] for i in ids], [a + 1 for a in accepted], read)
            seconds = machine.seconds(plan.k, plan.d, len(ids), context, plan.measure_depths, read)
            controller.observe(round_feedback(
                plan, batch_size=len(ids), context=context, num_proposed=proposed, num_accepted=accepted,
                seconds=seconds, request_ids=ids, **report,
            ))  # fmt: skip
            out["seconds"] += seconds
            out["rounds"] += 1
            out["speculative"] += plan.k > 0
            out["measured"] += plan.measure_depths
            out["plans"][plan.k, plan.d] = out["plans"].get((plan.k, plan.d), 0) + 1
            for i, a in zip(ids, accepted):
                position[i] += a + 1
                left[i] -= a + 1
                out["tokens"] += a + 1
                if left[i] <= 0:
                    del left[i]
    return out


def rotating_batches(
    count: int, size: int, offsets: list[int], counts: list[int], switch_every: int
) -> list[list[int]]:
    """`count` batches of `size` prompt indices: batch n from group (n // switch_every) mod groups (group g's prompts
    are offsets[g] .. offsets[g] + counts[g] - 1), rotating within it from offset 7n as bench_speculative.py's rounds
    do."""
    out = []
    for n in range(count):
        g = (n // switch_every) % len(counts)
        out.append([offsets[g] + (ROTATION_STRIDE * n + i) % counts[g] for i in range(size)])
    return out


def read_price_table(path: Path, model: str, error) -> dict[str, float]:
    """The prices of a `plan_prices.py --out` table for `model`; `error(message)` (naming the file) when it cannot
    be read, is for another model, or holds no price."""
    try:
        table = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        error(f"--price-table {path}: cannot read it as JSON ({err})")
    if not isinstance(table, dict) or table.get("model") != model:
        error(f"--price-table {path}: a table for model {table.get('model') if isinstance(table, dict) else None!r}, "
              f"not {model!r}")  # fmt: skip
    prices = table.get("prices")
    keys_ok = isinstance(prices, dict) and all(
        isinstance(k, str) and re.fullmatch(r"\d+,\d+@\d+", k) and isinstance(v, (int, float)) and v > 0
        for k, v in prices.items()
    )
    if not keys_ok or not prices:
        error(f"--price-table {path}: 'prices' must map \"K,d@B\" to a positive price, and hold at least one")
    return prices


def main(argv: list[str] | None = None) -> dict[int, dict[str, list[float]]]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-ouro")
    ap.add_argument("--prompts", default="eval", help="a prompt group or a prompt file, or several: 'prose,code'")
    ap.add_argument("--switch-every", type=int, default=4, help="with several groups: batches before the next group")
    ap.add_argument("--preset", help="the preset the controllers follow and whose profile prices rounds")
    ap.add_argument("--batch-sizes", default="1,8,32")
    ap.add_argument("--grid", default="none", help="fixed plans beside the controllers: 'K,d;K,d', auto or none")
    ap.add_argument("--policies", default="default", help="as bench_speculative.py's: 'default,default:FIELD=VALUE'")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--batches", type=int, default=0, help="rotating batches per batch size (0: enough for 64 prompts)")
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--noise", type=float, default=0.05, help="sd of a round's log-normal time noise")
    ap.add_argument("--speculative-price", type=float, default=1.0)
    ap.add_argument("--price-table", type=Path, help="plan_prices.py --out: each plan's measured price against plain")
    ap.add_argument("--measure-overhead", type=float, default=0.04)
    ap.add_argument("--context", type=float, default=150.0, help="mean context the rounds are priced at")
    ap.add_argument(
        "--switch-penalty",
        type=float,
        default=0.0,
        help="a plain round after a speculative one costs this share of a plain round at B = 1 more",
    )
    args = ap.parse_args(argv)
    if args.max_tokens < 2 or args.batches < 0 or args.seeds < 1 or args.noise < 0.0:
        ap.error("need --max-tokens >= 2, --batches >= 0, --seeds >= 1 and --noise >= 0")
    if not args.speculative_price > 0.0 or args.measure_overhead < 0.0 or args.switch_every < 1:
        ap.error("need --speculative-price > 0, --measure-overhead >= 0 and --switch-every >= 1")
    if args.switch_penalty < 0.0:
        ap.error("need --switch-penalty >= 0")
    try:
        groups = [
            parse_prompt_source(g, f"--prompts entry {g.strip()!r}:") for g in args.prompts.split(",") if g.strip()
        ]
    except ValueError as err:
        ap.error(str(err))
    if not groups:
        ap.error(f"--prompts {args.prompts!r}: need at least one prompt group or file")
    try:  # everything that can be checked before the model loads (the grid's d < D is checked once it has)
        for group in groups:
            check_prompt_source(group, "--prompts" if len(groups) == 1 else f"--prompts entry {group!r}")
        policies = parse_policies(args.policies)
        sizes = parse_batch_sizes(args.batch_sizes)
        check_grid_entries(args.grid, allow_none=True)
        check_model(args.model)
        check_preset(args.preset)
    except ValueError as err:
        ap.error(str(err))
    torch.set_num_threads(1)
    adapter = load_model(ap, args.model)
    depth = adapter.full_depth
    prices = read_price_table(args.price_table, adapter.name, ap.error) if args.price_table else None
    try:
        grid = parse_grid(args.grid, depth, allow_none=True)
        preset = preset_for(adapter, args.preset)  # as the engine finds it
    except ValueError as err:  # a grid cell at d >= D, or a preset that does not fit this model
        ap.error(str(err))
    # the machine's prices of every plan a controller can run, kept as lines per batch size (a plan outside the
    # options would be priced pass by pass every round)
    # (a measured round reads out the adaptive controller's draft depths, which it prices as the engine does)
    options = {o for b in compile_buckets(preset) for o in b.options}
    read = sorted({d for k, d in options if k})
    cost = PassCost(preset.cost, depth, options=sorted(options | set(grid)), readout_depths=read)
    # the groups' prompts one after another: group g's are the indices from offsets[g] on
    bits: list[list[list[int]]] = [[] for _ in range(depth)]
    offsets, counts, described, loaded = [], [], [], []
    try:
        for group in groups:
            loaded.append(load_prompts(group, rotation_size(group, max(sizes)), adapter))
            described.append(loaded[-1][1])
    except PromptSetError as err:  # e.g. a file's text for a model without a tokenizer
        ap.error(str(err))
    if policies:  # the controllers follow the preset: refuse to replay it on its own tuning prompts
        refuse_tuning_prompts("the adaptive controllers", preset, [p for prompts, _ in loaded for p in prompts])
    for prompts, _ in loaded:
        offsets.append(len(bits[0]))
        counts.append(len(prompts))
        for d, rows in enumerate(measure_match_bits(adapter, prompts, args.max_tokens)):
            bits[d].extend(rows)
    switching = f", switching every {args.switch_every} batches" if len(groups) > 1 else ""
    described = "; ".join(described) + switching
    price = f"plan prices of {args.price_table}" if prices else f"speculative price {args.speculative_price}"
    print(f"{adapter.name} D={depth}; {described}; {args.max_tokens} tokens; priced by preset {preset.model!r} "
          f"({preset.hardware}); noise {args.noise}, {args.seeds} seeds, {price}, "
          f"measure overhead {args.measure_overhead}")  # fmt: skip

    def controllers():
        yield "plain", lambda: FixedController(0, 0)
        for k, d in grid:
            yield f"{k},{d}", lambda k=k, d=d: FixedController(k, d)
        for policy, changes in policies:
            settings = ControlSettings(**dict(changes))
            make = lambda p=policy or "goodput", s=settings: AdaptiveController(preset, depth, p, s)  # noqa: E731
            yield adaptive_name(policy, changes), make

    results: dict[int, dict[str, list[float]]] = {}
    for b in sizes:
        count = args.batches or max(1, math.ceil(64 / b))
        batches = rotating_batches(count, b, offsets, counts, args.switch_every)
        print(f"B={b} ({count} batches): configuration, ÷ plain mean [min-max] over seeds, speculative / measured")
        rates: dict[str, list[float]] = {}
        for name, make in controllers():
            runs = []
            for seed in range(args.seeds):
                machine = Machine(
                    cost, args.noise, args.speculative_price, args.measure_overhead, seed, prices, args.switch_penalty
                )
                runs.append(drive(make(), bits, batches, machine, args.context))
            rates[name] = [r["tokens"] / r["seconds"] for r in runs]
            ratios = [x / p for x, p in zip(rates[name], rates["plain"])]
            spec = sum(r["speculative"] for r in runs) / sum(r["rounds"] for r in runs)
            measured = sum(r["measured"] for r in runs) / sum(r["rounds"] for r in runs)
            plans: dict[tuple[int, int], int] = {}
            for run in runs:
                for plan, count in run["plans"].items():
                    plans[plan] = plans.get(plan, 0) + count
            top = ", ".join(f"{k},{d}: {n / sum(plans.values()):.0%}" for (k, d), n in sorted(plans.items(),
                            key=lambda kv: -kv[1])[:3])  # fmt: skip
            print(f"  {name:44} {statistics.mean(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]  "
                  f"{spec:4.2f} / {measured:4.2f}  {top}")  # fmt: skip
        results[b] = rates
    return results


if __name__ == "__main__":
    main()
