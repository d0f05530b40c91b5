"""`looped-spec` command line: generate text with a shipped or local looped model."""

from __future__ import annotations

import argparse
import sys
import time


def _generate(args: argparse.Namespace) -> int:
    from looped_spec import LoopedSpecEngine, SamplingParams

    options = {}
    for item in args.adapter_option or []:
        key, _, value = item.partition("=")
        options[key] = int(value) if value.isdigit() else value
    engine = LoopedSpecEngine(args.model, dtype=args.dtype, device=args.device, speculation=args.speculation,
                              adapter_options=options or None, preset=args.preset, policy=args.policy,
                              seed=args.seed, trace_path=args.trace)  # fmt: skip
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos)  # fmt: skip
    prompts = args.prompt * args.batch_size
    start = time.perf_counter()
    outputs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    engine.close()
    out = outputs[0]
    print(args.prompt[0] + (out.text if out.text is not None else " ".join(map(str, out.token_ids))))
    stats = engine.stats
    num_tokens = sum(len(o.token_ids) for o in outputs)
    rows = [
        ("model", f"{engine.adapter.name} ({engine.adapter.model_type}, D={engine.adapter.full_depth})"),
        ("speculation", str(args.speculation)),
        ("requests", str(len(outputs))),
        ("tokens generated", str(num_tokens)),
        ("tokens/s", f"{num_tokens / elapsed:.1f}"),
        ("decode rounds", f"{stats.num_rounds} ({stats.num_spec_rounds} speculative)"),
        ("tokens per round", f"{(num_tokens - len(outputs)) / max(stats.num_rounds, 1):.2f}"),
        (
            "draft tokens accepted",
            f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} ({100 * stats.acceptance_rate:.1f}%)",
        ),  # fmt: skip
        ("plans used (K,d: rounds)", ", ".join(f"{k}: {v}" for k, v in sorted(stats.plan_histogram.items()))),
    ]
    width = max(len(k) for k, _ in rows)
    print("\n" + "-" * (width + 40))
    for key, value in rows:
        print(f"{key:<{width}}  {value}")
    return 0


def _models(args: argparse.Namespace) -> int:
    from looped_spec.models import shipped_models

    for name, path in shipped_models().items():
        print(f"{name}\t{path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="looped-spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation and print speculation stats")
    gen.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--speculation", default="adaptive", help="off | adaptive | K,d")
    gen.add_argument("--policy", default="ema", choices=["ema", "goodput"])
    gen.add_argument("--preset", default=None, help="preset file (default: matched by model name)")
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--top-k", type=int, default=0)
    gen.add_argument("--top-p", type=float, default=1.0)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--batch-size", type=int, default=1, help="run the prompt(s) this many times together")
    gen.add_argument("--dtype", default="auto")
    gen.add_argument("--device", default="auto")
    gen.add_argument("--trace", default=None, help="write the controller's JSONL trace here")
    gen.add_argument("--adapter-option", action="append", help="KEY=VALUE passed to the adapter")
    gen.set_defaults(func=_generate)
    models = sub.add_parser("models", help="list the shipped tiny models")
    models.set_defaults(func=_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
        print(f"looped-spec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
