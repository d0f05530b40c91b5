"""`looped-spec` command line: generate text with a shipped or local looped model, or tune its preset."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit status 2."""


def _output_file(value: str, option: str) -> Path:
    """A path a command will write: not a directory, and not under an existing file. Checked before any work."""
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{option} {value}: is a directory; give a file path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{option} {value}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK):
                raise UsageError(f"{option} {value}: cannot write in {parent}")
            break
    return path


def _at_least(value: int, minimum: int, option: str, note: str = "") -> None:
    if value < minimum:
        raise UsageError(f"{option} {value}: must be >= {minimum}{note}")


def _generate(args: argparse.Namespace) -> int:
    from looped_spec import LoopedSpecEngine, SamplingParams

    if args.trace is not None:
        _output_file(args.trace, "--trace")
    _at_least(args.batch_size, 1, "--batch-size")
    _at_least(args.max_tokens, 1, "--max-tokens")
    options = {}
    for item in args.adapter_option or []:
        key, _, value = item.partition("=")
        options[key] = int(value) if value.isdigit() else value
    exits = args.exit_threshold is not None or args.exit_at_step is not None
    if args.speculation is None:  # early exit runs with plain decoding only (for now)
        args.speculation = "off" if exits else "adaptive"
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos,
                            exit_threshold=args.exit_threshold, exit_at_step=args.exit_at_step)  # fmt: skip
    engine = LoopedSpecEngine(args.model, dtype=args.dtype, device=args.device, speculation=args.speculation,
                              adapter_options=options or None, preset=args.preset, policy=args.policy,
                              seed=args.seed, trace_path=args.trace, early_exit=args.early_exit)  # fmt: skip
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
    if stats.exit_depth_histogram:
        histogram = ", ".join(f"{d}: {n}" for d, n in sorted(stats.exit_depth_histogram.items()))
        rows += [
            (f"exit depths ({args.early_exit}; depth: tokens)", histogram),
            ("loops per token (saved)", f"{stats.mean_loops_per_token:.2f} ({stats.num_exit_loops_saved})"),
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

    from looped_spec.control.presets import load_preset
    from looped_spec.tuner import GreedyMismatchError, tune
    from looped_spec.tuner_inputs import parse_adapter_options
    from looped_spec.tuner_report import dump_json, format_table, preset_data, write_heatmap

    out = _output_file(args.out, "--out")  # before measuring, which takes minutes
    if args.heatmap:
        _output_file(args.heatmap, "--heatmap")
    _at_least(args.threads, 0, "--threads", " (0: torch's default)")
    for option in ("screen_tokens", "confirm_tokens", "top", "repeats"):
        _at_least(getattr(args, option), 1, "--" + option.replace("_", "-"))
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    argv = args.argv if args.argv is not None else sys.argv[1:]  # set by main()
    start = time.perf_counter()
    try:
        config, report = tune(
            args.model,
            args.batch_sizes,
            args.prompts,
            args.grid,
            args.screen_tokens,
            args.confirm_tokens,
            args.top,
            repeats=args.repeats,
            hardware=args.hardware,
            dtype=args.dtype,
            device=args.device,
            adapter_options=parse_adapter_options(args.adapter_option),
            command="looped-spec " + shlex.join(argv),
            progress=not args.quiet,
        )
    except GreedyMismatchError as exc:
        print(f"looped-spec: BUG: {exc}", file=sys.stderr)
        return 1
    data = preset_data(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dump_json(data), encoding="utf-8")
    load_preset(config.model, config.full_depth or 1, preset=out)  # re-read: what the engine will see
    measurements = {int(b): m for b, m in report["measurements"].items()}
    print(format_table(measurements, data))
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    if args.heatmap is not None:
        png = Path(args.heatmap) if args.heatmap else out.with_suffix(".png")
        png.parent.mkdir(parents=True, exist_ok=True)
        skipped = write_heatmap(measurements, png, f"{config.model} on {config.hardware}")
        print(f"looped-spec: {skipped}" if skipped else f"wrote {png}", file=sys.stderr if skipped else sys.stdout)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="looped-spec", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate a continuation and print speculation stats")
    gen.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    gen.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument(
        "--speculation", default=None, help="off | adaptive | K,d (default: adaptive; off with early exit)"
    )
    gen.add_argument("--exit-threshold", type=float, default=None, help="early exit: the family rule's threshold")
    gen.add_argument("--exit-at-step", type=int, default=None, help="early exit: fixed loop depth per token")
    gen.add_argument("--early-exit", default="skip", choices=["skip", "select"], help="how early exit runs")
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
    tune = sub.add_parser(
        "tune",
        help="measure (K, d) against plain decoding and write a preset file",
        description="Screen the (K, d) grid per batch size, confirm the best cells with longer "
        "outputs and write a validated adaptive-speculation preset "
        "(rules: looped_spec.tuner_rules).",
    )
    tune.add_argument("--model", required=True, help="checkpoint folder or shipped model name")
    tune.add_argument("--batch-sizes", default="1,8,32", help="comma-separated batch sizes to measure")
    tune.add_argument("--prompts", default="builtin", help="builtin | FILE (.txt: one prompt a line; .jsonl: prompt)")
    tune.add_argument("--out", required=True, help="preset JSON to write, e.g. presets/NAME.json")
    tune.add_argument("--grid", default="auto", help='auto | "K,d;K,d;..." (1 <= d < D)')
    tune.add_argument("--screen-tokens", type=int, default=16, help="output tokens per request when screening")
    tune.add_argument("--confirm-tokens", type=int, default=64, help="output tokens per request when confirming")
    tune.add_argument("--top", type=int, default=3, help="cells per batch size to confirm (bucket candidates)")
    tune.add_argument("--repeats", type=int, default=3, help="confirm repeats (median)")
    tune.add_argument("--hardware", default=None, help="hardware tag for the preset (default: cpu / GPU name)")
    tune.add_argument(
        "--heatmap",
        nargs="?",
        const="",
        default=None,
        metavar="OUT.png",
        help="write speedup/acceptance heatmaps (default path: --out with .png)",
    )
    tune.add_argument("--dtype", default="auto")
    tune.add_argument("--device", default="auto")
    tune.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
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
    except (ValueError, KeyError, TypeError, OSError) as exc:
        # one line, whatever the message (pydantic and tokenizer errors span several)
        print(f"looped-spec: error: {' '.join(str(exc).split())}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
