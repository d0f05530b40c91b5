"""Tune an adaptive-speculation preset for a model, then run the engine with that preset.

A small run (two batch sizes, a 3-cell grid, few prompts and rounds) so it finishes in well under a minute
on a CPU; real tuning uses more (see `looped-spec tune --help` and docs/adaptive.md).

    python examples/tune_preset.py --out /tmp/tiny-ouro.json
"""

from __future__ import annotations

import argparse
import sys

import torch

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.cli import main as looped_spec_cli


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    parser.add_argument("--out", default="tuned-preset.json", help="preset file to write")
    parser.add_argument("--tokens", type=int, default=8, help="greedy tokens per prompt in the acceptance pass")
    args = parser.parse_args()
    torch.set_num_threads(1)

    # the same as: looped-spec tune --model tiny-ouro --batch-sizes 1,4 --grid "1,1;2,1;1,2" ... --out ...
    rc = looped_spec_cli(["tune", "--model", args.model, "--batch-sizes", "1,4", "--grid", "1,1;2,1;1,2",
                          "--acceptance-tokens", str(args.tokens), "--num-prompts", "4", "--round-tokens", "4",
                          "--repeats", "1", "--threads", "1", "--quiet", "--out", args.out])  # fmt: skip
    if rc != 0:
        sys.exit(rc)
    engine = LoopedSpecEngine(args.model, speculation="adaptive", preset=args.out)
    out = engine.generate("def fibonacci(n):", SamplingParams(max_tokens=16, temperature=0.0))[0]
    print(f"with the tuned preset: {out.text!r}; plans used: {dict(engine.stats.plan_histogram)}")
    engine.close()


if __name__ == "__main__":
    main()
