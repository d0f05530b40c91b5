"""How many rounds adaptive speculation needs to move when the workload changes (nothing timed against anything).

Runs one adaptive engine through a changing workload, the phases of `bench_speculative.py --workload` (each
phase one batch of B prompts from its group, decoded to the end), repeated; the engine keeps what it learned
from phase to phase. Per phase it reads the plan of every decode round from the controller's trace and prints:

- `moved`: the first round whose plan differs from the last plan of the phase before (`-`: it never moved);
- `settled`: the first round on the plan the phase ran most (its `mode`), and the share of rounds on it;
- `alpha1`: the learned agreement at draft depth 1 after the phase (the preset's tuning value in the header).

Plans follow acceptance, which is deterministic for a text, and the pass-cost profile, and through the rounds' own
times three things that are not: the drift factor (every plan alike), the spacing of the measured rounds, and the
price probes' pairs of rounds, which move each plan's learned price against plain (docs/adaptive.md "Prices on
another machine"), so two runs agree on the pattern, not round for round. With
`--result` (a bench_speculative.py result with `--workload`) the screen's per-phase oracle is printed beside
the mode.

    python benchmarks/adaptation_rounds.py --model tiny-ouro --workload-phases 1:code,8:prose,32:code,8:eval,1:prose \
        --result benchmarks/results/tiny-ouro-code.json
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import tempfile
from pathlib import Path

import torch

from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
from looped_spec.tuning.grid import Phase, parse_phases, prompt_source_flag
from looped_spec.tuning.prompt_sets import is_prompt_file, load_prompts

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_speculative import PromptPool, phase_slices, rotation_size  # noqa: E402


def new_plans(trace) -> list[str]:
    """The decode rounds' plans ("K,d") written to the open trace file since the last call."""
    events = (json.loads(line) for line in trace.read().splitlines())
    return [f"{e['k']},{e['d']}" for e in events if e["event"] == "plan"]


def phase_summary(plans: list[str], before: str | None) -> tuple[int | None, int, str, float]:
    """(moved, settled, mode, its share) of one phase's plans; `before`: the last plan of the phase before."""
    mode, count = collections.Counter(plans).most_common(1)[0]
    moved = 0 if before is None else next((r for r, p in enumerate(plans) if p != before), None)
    return moved, plans.index(mode), mode, count / len(plans)


def result_oracle(path: Path, phases: list[Phase]) -> list[str]:
    """The per-phase oracle of a bench_speculative.py --workload result, whose phases must be these (batch size and
    group, in order): an oracle chosen for other phases, printed beside these, would label them wrongly."""
    workload = json.loads(path.read_text())["workload"]
    groups = workload.get("phase_groups")  # none in files written before B:GROUP phases: batch sizes only
    ran = [f"{b}:{g}" if groups else str(b) for b, g in zip(workload["phases"], groups or workload["phases"])]
    asked = [f"{p.batch}:{p.group}" if groups else str(p.batch) for p in phases]
    if ran != asked:
        raise SystemExit(f"--result {path}: its workload ran the phases {','.join(ran)}, --workload-phases gives "
                         f"{','.join(asked)}; its oracle belongs to its own phases")  # fmt: skip
    return workload["oracle_phases"]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="tiny-ouro")
    ap.add_argument("--prompts", default="code", type=prompt_source_flag, help="group of phases without one")
    ap.add_argument("--workload-phases", default="1:code,8:prose,32:code,8:eval,1:prose")
    ap.add_argument("--repeats", type=int, default=3, help="times the whole workload runs on the same engine")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--result", type=Path, help="a bench_speculative.py --workload result: print its oracle")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    phases = parse_phases(args.workload_phases, args.prompts)
    oracle = result_oracle(args.result, phases) if args.result else None

    adapter = load_adapter(args.model)
    # the bench's prompt pools and slices: each group loaded once, the phases of a group reading consecutive slices,
    # every pool rotated by the repeat
    slices = phase_slices(phases, lambda group: group)
    pools = {}
    for source, _, _ in slices:
        if source not in pools:
            count = rotation_size(source, sum(size for s, _, size in slices if s == source))
            pools[source] = PromptPool(load_prompts(source, count, adapter)[0], rotate=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.jsonl"
        engine = LoopedSpecEngine(adapter, max_batch_size=max(p.batch for p in phases), seed=0, trace_path=path)
        params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        print(f"{args.model}: preset alpha1 {engine.controller.stats()['alpha'][0]:.2f}; phases {args.workload_phases}")
        # a phase by its batch size and source: a prompt file by its name, so the columns stay aligned
        labels = [f"{p.batch}:{Path(p.group).name if is_prompt_file(p.group) else p.group}" for p in phases]
        width = max(10, *map(len, labels))
        header = f"repeat  {'phase':<{width}} rounds  moved  settled  mode (share)      alpha1  "
        print(header + ("oracle" if oracle else ""))
        last = None
        with path.open(encoding="utf-8") as trace:
            for repeat in range(args.repeats):
                for i, (source, start, size) in enumerate(slices):
                    engine.generate(pools[source].slice(start, size), params)
                    engine.controller.flush_trace()
                    plans = new_plans(trace)
                    moved, settled, mode, share = phase_summary(plans, last)
                    alpha1 = engine.controller.stats()["alpha"][0]
                    shown = "-" if moved is None else moved
                    line = f"{repeat:>6}  {labels[i]:<{width}} {len(plans):>6}  {shown:>5}"
                    line += f"  {settled:>7}  {mode:<5} ({share:.2f})      {alpha1:.2f}"
                    print(line + (f"  {oracle[i]}" if oracle else ""))
                    last = plans[-1]
                for pool in pools.values():
                    pool.next_round()
        engine.close()


if __name__ == "__main__":
    main()
