"""`looped-spec` command line: generate text with a shipped or local looped model, or tune its preset."""

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


def _tune(args: argparse.Namespace) -> int:
    import shlex
    from pathlib import Path

    from looped_spec.control.presets import load_preset, read_preset_file
    from looped_spec.tuner import tune
    from looped_spec.tuner_inputs import TunerError, parse_adapter_options
    from looped_spec.tuner_report import dump_json, format_report, preset_data, write_heatmap

    out = Path(args.out)
    if out.is_dir() or (out.parent.exists() and not out.parent.is_dir()):
        raise TunerError(f"--out {out}: not a writable file path")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    argv = args.argv if args.argv is not None else sys.argv[1:]  # set by main()
    cost = {}
    if args.cost_from:
        source = read_preset_file(args.cost_from)
        if source.cost is None:
            raise TunerError(f"--cost-from {args.cost_from}: the preset has no measured cost profile")
        prov = source.provenance if isinstance(source.provenance, dict) else {}
        measured = prov.get("cost_measured") or prov.get("date")
        cost = {
            "cost_profile": source.cost.model_dump(),
            "cost_report": prov.get("cost", {}),
            "cost_profile_source": f"from {args.cost_from}",
            "cost_measured": measured,
        }
    start = time.perf_counter()
    config, report = tune(
        args.model,
        args.batch_sizes,
        args.prompts,
        args.grid,
        acceptance_tokens=args.acceptance_tokens,
        num_prompts=args.num_prompts,
        profile_rounds=args.profile_rounds,
        repeats=args.repeats,
        hardware=args.hardware,
        dtype=args.dtype,
        device=args.device,
        adapter_options=parse_adapter_options(args.adapter_option),
        seed=args.seed,
        **cost,
        command="looped-spec " + shlex.join(argv),
        progress=not args.quiet,
    )
    data = preset_data(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_json(data), encoding="utf-8")
    load_preset(config.model, config.full_depth or 1, preset=out)  # re-read: what the engine will see
    print(format_report(report, data))
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    if args.heatmap is not None:
        png = Path(args.heatmap) if args.heatmap else out.with_suffix(".png")
        png.parent.mkdir(parents=True, exist_ok=True)
        write_heatmap(report, png, f"{config.model} on {config.hardware}")
        print(f"wrote {png}")
    return 0


def _positive(minimum: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {value}")
        return value

    return parse


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="looped-spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation and print speculation stats")
    gen.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--speculation", default="adaptive", help="off | adaptive | K,d")
    gen.add_argument("--policy", default="goodput", choices=["goodput", "ema"])
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
    tune = sub.add_parser(
        "tune",
        help="measure acceptance and round cost, write a preset file",
        description="Measure per-depth acceptance with counterfactual readouts (deterministic) and the round "
        "cost of every (K, d) per batch size (interleaved, repeated, medians), then derive a validated "
        "adaptive-speculation preset (rules: looped_spec.control.derive; docs/adaptive.md).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    tune.add_argument("--model", required=True, help="checkpoint folder or shipped model name")
    tune.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated batch sizes to profile")
    tune.add_argument(
        "--prompts", default="tune", help="tune | builtin | FILE (.txt: one prompt a line; .jsonl: prompt)"
    )
    tune.add_argument("--out", required=True, help="preset JSON to write, e.g. presets/NAME.json")
    tune.add_argument("--grid", default="auto", help='auto | "K,d;K,d;..." (1 <= d < D)')
    tune.add_argument(
        "--acceptance-tokens", type=_positive(2), default=96, help="greedy tokens per prompt (acceptance pass)"
    )
    tune.add_argument("--num-prompts", type=_positive(1), default=32, help="prompts in the acceptance pass")
    tune.add_argument("--profile-rounds", type=_positive(1), default=12, help="timed rounds per config and repeat")
    tune.add_argument("--repeats", type=_positive(1), default=4, help="timed repeats (one more is run and dropped)")
    tune.add_argument("--seed", type=int, default=0, help="seed of the interleaving order")
    tune.add_argument(
        "--cost-from",
        default=None,
        metavar="PRESET",
        help="reuse this preset's measured cost profile instead of timing (re-derive after a rules change)",
    )
    tune.add_argument("--hardware", default=None, help="hardware tag for the preset (default: cpu / GPU name)")
    tune.add_argument(
        "--heatmap",
        nargs="?",
        const="",
        default=None,
        metavar="OUT.png",
        help="write predicted-speedup/acceptance heatmaps (default path: --out with .png)",
    )
    tune.add_argument("--dtype", default="auto")
    tune.add_argument("--device", default="auto")
    tune.add_argument("--threads", type=_positive(0), default=0, help="torch CPU threads (0: torch's default)")
    tune.add_argument("--adapter-option", action="append", help="KEY=VALUE passed to the adapter")
    tune.add_argument("--quiet", action="store_true", help="no progress bar")
    tune.set_defaults(func=_tune, argv=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "tune":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return args.func(args)
    except (ValueError, KeyError, TypeError, FileNotFoundError) as exc:
        print(f"looped-spec: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
