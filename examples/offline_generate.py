"""Offline batch generation: prompts in, outputs and speculation stats out.

python examples/offline_generate.py --model tiny-ouro --max-tokens 48
"""

from __future__ import annotations

import argparse

import torch

from looped_spec import LoopedSpecEngine, SamplingParams

PROMPTS = ["def fibonacci(n):", "import os", "class Stack:"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    parser.add_argument("--max-tokens", type=int, default=48)
    args = parser.parse_args()
    torch.set_num_threads(1)  # tiny models: one thread is fastest on a small shared CPU

    engine = LoopedSpecEngine(args.model, speculation="adaptive")
    outputs = engine.generate(PROMPTS, SamplingParams(max_tokens=args.max_tokens, temperature=0.0))
    for prompt, out in zip(PROMPTS, outputs):
        print(f"--- {prompt!r} ({len(out.token_ids)} tokens, {out.finish_reason})")
        print(prompt + out.text)
    stats = engine.stats
    print(f"\ndraft tokens accepted: {stats.num_accepted_tokens}/{stats.num_draft_tokens}, "
          f"plans used (K,d: rounds): {dict(stats.plan_histogram)}")  # fmt: skip
    engine.close()


if __name__ == "__main__":
    main()
