"""Per-call cost of the adaptive controller: plan() + observe() on a simulated workload, no model.

Prints, per policy, the wall time the controller spends per call (what `stats()["overhead_us_per_call"]`
reports in a real run), with a shipped preset and batch sizes stepping 1..16.

    python benchmarks/bench_controller.py --preset ouro-1.4b --rounds 3000
"""

from __future__ import annotations

import argparse

from looped_spec.control import AdaptiveController, load_preset
from looped_spec.control.controller import POLICIES
from looped_spec.control.simulate import SyntheticWorkload


def overhead_us(policy: str, preset: str, depth: int, alpha: list[float], rounds: int) -> float:
    """Microseconds per plan() or observe() call over `rounds` simulated rounds."""
    ctl = AdaptiveController(load_preset(preset, depth, preset), depth, policy=policy)
    sim = SyntheticWorkload(depth, alpha, seed=3)
    for i in range(rounds):
        batch = 1 + (i // 500) % 16
        plan = ctl.plan(batch)
        ctl.observe(sim.feedback(plan, batch))
    return ctl.stats()["overhead_us_per_call"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="ouro-1.4b", help="shipped preset name or preset file")
    parser.add_argument("--depth", type=int, default=4, help="the model's full depth D")
    parser.add_argument("--alpha", default="0.7,0.87,0.94,1.0", help="simulated acceptance per draft depth 1..D")
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    alpha = [float(a) for a in args.alpha.split(",")]
    if len(alpha) != args.depth:
        parser.error(f"--alpha has {len(alpha)} values for depth {args.depth}")
    for policy in POLICIES:
        us = overhead_us(policy, args.preset, args.depth, alpha, args.rounds)
        print(f"[{policy}] plan+observe overhead: {us:.2f} us per call ({args.rounds} rounds)")


if __name__ == "__main__":
    main()
