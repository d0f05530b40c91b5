"""`looped-spec tune`: measure a model's acceptance and pass costs and write its adaptive-speculation preset."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from looped_spec.cli.common import UsageError, at_least, output_file, set_threads


def add_parser(sub: argparse._SubParsersAction, fmt: type[argparse.HelpFormatter]) -> None:
    tune = sub.add_parser(
        "tune",
        help="measure acceptance and round cost, write a preset file",
        description="Measure per-depth acceptance with counterfactual readouts (deterministic) and the pass-cost "
        "profile (timed steps on a grid of shapes and interleaved rounds of a few plans), then derive a validated "
        "adaptive-speculation preset (rules: looped_spec.tuning.derive; docs/adaptive.md).",
        formatter_class=fmt,
    )
    tune.add_argument("--model", required=True, help="checkpoint folder or shipped model name")
    tune.add_argument("--batch-sizes", default="1,2,4,8,16,32", help="comma-separated batch sizes to profile")
    tune.add_argument(
        "--prompts",
        default="tune",
        help="tune | builtin | random | FILE (.txt: one prompt a line; .jsonl: prompt); the evaluation groups "
        "(eval, code, prose) are refused (looped_spec.tuning.prompt_sets)",
    )
    tune.add_argument("--out", required=True, help="preset JSON to write, e.g. presets/NAME.json")
    tune.add_argument(
        "--grid",
        default="auto",
        help='auto (K 1..5 x d 1..D-1; d in 1,2,D/4,D/2,D-1 for D > 5) | full (K 1..8 x every d) | "K,d;K,d;..." '
        "(1 <= d < D; looped_spec.tuning.grid)",
    )
    tune.add_argument("--acceptance-tokens", type=int, default=96, help="greedy tokens per prompt (acceptance pass)")
    tune.add_argument("--num-prompts", type=int, default=32, help="prompts in the acceptance pass")
    tune.add_argument("--round-tokens", type=int, default=None,
                      help="generated tokens per request in the timed rounds; none: 32")  # fmt: skip
    tune.add_argument("--repeats", type=int, default=None, help="timed repeats (one more is run and dropped); none: 4")
    tune.add_argument("--seed", type=int, default=0, help="seed of the interleaving order")
    tune.add_argument(
        "--cost-from",
        default=None,
        metavar="PRESET",
        help="reuse this preset's (a file or shipped name, for the same model) measured cost profile instead of "
        "timing (re-derive after a rules change)",
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
    tune.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    tune.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    tune.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    tune.add_argument("--adapter-option", action="append", metavar="KEY=VALUE", help="passed to the adapter "
                      "(repeatable)")  # fmt: skip
    tune.add_argument("--quiet", action="store_true", help="no progress bar")
    tune.set_defaults(func=tune_command, argv=None)


def tune_command(args: argparse.Namespace) -> int:
    import shlex

    from looped_spec.models.adapter import resolve_model_path
    from looped_spec.models.checkpoint import read_config
    from looped_spec.presets.lookup import is_for, load_preset, model_names, read_preset_file, shipped_preset_path
    from looped_spec.tuning.inputs import parse_adapter_options
    from looped_spec.tuning.report import dump_json, format_report, preset_data, write_heatmap
    from looped_spec.tuning.tuner import tune

    out = output_file(args.out, "--out")  # before measuring, which takes minutes
    if args.heatmap:
        output_file(args.heatmap, "--heatmap")
    if args.heatmap is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--heatmap needs matplotlib (pip install matplotlib)") from None
    at_least(args.threads, 0, "--threads", " (0: torch's default)")
    at_least(args.acceptance_tokens, 2, "--acceptance-tokens", " (the first token comes from prefill)")
    timing = {"round_tokens": 32, "repeats": 4}  # the timed rounds' defaults; no rounds are timed with --cost-from
    for option, default in timing.items():
        flag = "--" + option.replace("_", "-")
        if args.cost_from and getattr(args, option) is not None:
            raise UsageError(f"{flag}: times rounds, which --cost-from skips (it reuses a measured profile)")
        setattr(args, option, default if getattr(args, option) is None else getattr(args, option))
    at_least(args.round_tokens, 2, "--round-tokens")
    for option in ("num_prompts", "repeats"):
        at_least(getattr(args, option), 1, "--" + option.replace("_", "-"))
    set_threads(args.threads)
    argv = args.argv if args.argv is not None else sys.argv[1:]  # set by main()
    cost = {}
    if args.cost_from:
        path = Path(args.cost_from)
        if not path.is_file() and shipped_preset_path(args.cost_from) is not None:
            path = shipped_preset_path(args.cost_from)  # a shipped preset's name, as --preset takes
        source = read_preset_file(path)
        folder = resolve_model_path(args.model).resolve()
        names = model_names(folder.name, folder, read_config(folder))
        if not is_for(source.model, names):
            raise UsageError(f"--cost-from {args.cost_from}: its cost profile was measured on model "
                             f"{source.model!r}, not {names[0][0]!r} (omit --cost-from to measure it)")  # fmt: skip
        prov = source.provenance if isinstance(source.provenance, dict) else {}
        cost = {
            "cost_profile": source.cost.model_dump(),
            "cost_report": prov.get("cost", {}),
            "cost_profile_source": f"from {args.cost_from}",
            "cost_measured": prov.get("cost_measured") or prov.get("date"),
        }
    start = time.perf_counter()
    config, report = tune(
        args.model,
        args.batch_sizes,
        args.prompts,
        args.grid,
        acceptance_tokens=args.acceptance_tokens,
        num_prompts=args.num_prompts,
        round_tokens=args.round_tokens,
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
    load_preset(config.model, config.full_depth, preset=out)  # re-read: what the engine will see
    print(format_report(report, data))
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    if args.heatmap is not None:
        png = Path(args.heatmap) if args.heatmap else out.with_suffix(".png")
        png.parent.mkdir(parents=True, exist_ok=True)
        write_heatmap(report, png, f"{config.model} on {config.hardware}")
        print(f"wrote {png}")
    return 0
