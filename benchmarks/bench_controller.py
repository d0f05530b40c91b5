"""Per-call cost of the adaptive controller: plan() + observe() on a synthetic workload, no model.

Prints, per policy, the wall time the controller spends per call (what `stats()["overhead_us_per_call"]`
reports in a real run), with a shipped preset, batch sizes stepping 1..16 and text that changes every 500 rounds.

    python benchmarks/bench_controller.py --preset tiny-ouro --rounds 3000
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))  # the tests' synthetic workload
from workload import Phase, Workload  # noqa: E402

from looped_spec.control import AdaptiveController  # noqa: E402
from looped_spec.control.controller import POLICIES  # noqa: E402
from looped_spec.control.passcost import PassCost  # noqa: E402
from looped_spec.presets import load_preset  # noqa: E402


def overhead_us(policy: str, preset: str, alpha: list[float], rounds: int) -> float:
    """Microseconds per plan() or observe() call over `rounds` simulated rounds."""
    depth = len(alpha)
    config = load_preset(preset, depth, preset)
    controller = AdaptiveController(config, depth, policy=policy)
    harder = [a * 0.6 for a in alpha[:-1]] + [1.0]
    phases = [Phase(1 + (i % 16), alpha if (i // 10) % 2 else harder, 50) for i in range(rounds // 50)]
    Workload(PassCost(config.cost, depth), seed=3).run(controller, phases)
    return controller.stats()["overhead_us_per_call"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny-ouro", help="shipped preset name or preset file")
    parser.add_argument("--alpha", default="0.7,0.87,0.94,1.0", help="simulated agreement per draft depth 1..D")
    parser.add_argument("--rounds", type=int, default=3000)
    args = parser.parse_args()
    alpha = [float(a) for a in args.alpha.split(",")]
    for policy in POLICIES:
        us = overhead_us(policy, args.preset, alpha, args.rounds)
        print(f"[{policy}] plan+observe overhead: {us:.2f} us per call ({args.rounds} rounds)")


if __name__ == "__main__":
    main()
