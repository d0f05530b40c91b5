"""What each plan's round costs next to plain decoding on this machine now, against what the preset's profile says.

Times rounds the way the tuner does (`tuning.profile.measure_rounds`: one persistent engine per plan and batch size,
all taking turns of one round in a shuffled order, so every cell is timed in the same machine state), keeps the
rounds in which every request drafted the plan's K, and prints per plan and batch size

    price = median over its rounds of log(measured ÷ profile seconds), minus plain's at that batch size

as a ratio: 1.00 where the profile prices the plan against plain as this machine runs it, 1.20 where the plan costs
20 % more next to plain than the profile says. That relative price is what decides between plans; the controller
learns one shared price of speculation online (docs/adaptive.md "Prices on another machine"), so the spread of this
table over plans is what it cannot learn. `--out` writes the table for `replay_controller.py --price-table`, whose
machine then charges each plan its measured price.

    python benchmarks/plan_prices.py --model tiny-ouro --prompts code --threads 1 \\
        --grid "1,1;2,1;3,1;5,1;1,2;2,2;3,2;2,3;3,3" --batch-sizes 1,4,8,16,32 --out /tmp/prices-t1.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import sys
from pathlib import Path

import torch

from looped_spec.control.passcost import PassCost
from looped_spec.presets.lookup import preset_for
from looped_spec.tuning import profile
from looped_spec.tuning.grid import parse_batch_sizes, parse_grid, prompt_source_flag
from looped_spec.tuning.prompt_sets import load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import check_grid_entries, check_model, check_out_path, check_preset, check_prompt_source, load_model  # noqa: E402

#: Rounds a cell needs before its median counts (the last rounds of a batch draft fewer and are dropped)
MIN_ROUNDS = 3


def cell_key(k: int, d: int, batch: int) -> str:
    return f"{k},{d}@{batch}"


def relative_prices(rounds, cost: PassCost, sizes) -> tuple[dict[str, float], dict[str, int]]:
    """Per (plan, batch size of `sizes`) with plain timed at the same batch size: exp(median log(measured ÷ profile)
    − plain's); and the rounds behind every cell (plain's included). Rounds at other batch sizes (a batch whose first
    requests finished) are left out."""
    logs: dict[tuple[int, int, int], list[float]] = {}
    for fb, _ in profile.full_shape(rounds):
        if fb.batch_size not in sizes:
            continue
        k = fb.k if fb.total_proposed else 0
        plan = (k, fb.d if k else 0)
        predicted = cost.seconds(*plan, fb.batch_size, fb.context)
        if fb.seconds > 0.0 and predicted > 0.0:
            logs.setdefault((*plan, fb.batch_size), []).append(math.log(fb.seconds / predicted))
    medians = {key: statistics.median(v) for key, v in logs.items() if len(v) >= MIN_ROUNDS}
    prices = {
        cell_key(k, d, b): round(math.exp(x - medians[(0, 0, b)]), 4)
        for (k, d, b), x in sorted(medians.items())
        if k > 0 and (0, 0, b) in medians
    }
    counts = {cell_key(*key): len(v) for key, v in sorted(logs.items())}
    return prices, counts


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="tiny-ouro")
    ap.add_argument("--preset", help="the preset whose profile the rounds are compared with (default: the model's)")
    ap.add_argument("--prompts", default="code", type=prompt_source_flag, help="a prompt group or a prompt file")
    ap.add_argument("--grid", default="auto", help="the speculative plans: 'K,d;K,d' or auto (plain is always timed)")
    ap.add_argument("--batch-sizes", default="1,4,8,16,32")
    ap.add_argument("--tokens", type=int, default=32, help="new tokens a request decodes in each repeat")
    ap.add_argument("--repeats", type=int, default=3, help="batches each engine decodes after a warm-up one")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="write the table here (JSON)")
    args = ap.parse_args(argv)
    if args.tokens < 2 or args.repeats < 1 or args.threads < 0:
        ap.error("need --tokens >= 2, --repeats >= 1 and --threads >= 0")
    try:  # before the model loads, and the out file before the rounds are timed
        sizes = parse_batch_sizes(args.batch_sizes)
        check_grid_entries(args.grid)
        check_model(args.model)
        check_preset(args.preset)
        check_prompt_source(args.prompts)
        if args.out is not None:
            check_out_path(args.out)
    except ValueError as err:
        ap.error(str(err))
    if args.threads:
        torch.set_num_threads(args.threads)
    adapter = load_model(ap, args.model)
    depth = adapter.full_depth
    try:
        grid = parse_grid(args.grid, depth)  # d < D, now that D is known
        preset = preset_for(adapter, args.preset)  # as the engine finds it
        prompts, about = load_prompts(args.prompts, max(64, max(sizes)), adapter)
    except ValueError as err:  # a preset that does not fit this model, a file's text for a model without a tokenizer
        ap.error(str(err))
    cost = PassCost(preset.cost, depth)
    plans = sorted({(0, 0), *grid})
    rounds = profile.measure_rounds(adapter, prompts, sizes, plans, args.tokens, args.repeats, args.seed)
    prices, counts = relative_prices(rounds, cost, set(sizes))
    print(f"{adapter.name} D={depth}; {about}; {torch.get_num_threads()} threads; against preset {preset.model!r} "
          f"({preset.hardware}): a plan's round ÷ plain's, measured ÷ profile")  # fmt: skip
    width = max(len(f"{k},{d}") for k, d in grid)
    print(f"  {'plan':>{width}}  " + "  ".join(f"B={b:<4}" for b in sizes))
    for k, d in grid:
        cells = [prices.get(cell_key(k, d, b)) for b in sizes]
        print(f"  {f'{k},{d}':>{width}}  " + "  ".join("  -   " if p is None else f"{p:6.3f}" for p in cells))
    logs = [math.log(p) for p in prices.values()]
    if logs:
        print(f"  spread over the cells (sd of log price): {statistics.pstdev(logs):.3f}; one shared price would "
              f"be {math.exp(statistics.mean(logs)):.3f}")  # fmt: skip
    else:
        print(f"  no cell had {MIN_ROUNDS} full rounds beside plain's: more --tokens or --repeats")
    result = {
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "model": adapter.name,
        "depth": depth,
        "preset": preset.model,
        "preset_hardware": preset.hardware,
        "threads": torch.get_num_threads(),
        "prompts": about,
        "prices": prices,
        "rounds": counts,
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result


if __name__ == "__main__":
    main()
