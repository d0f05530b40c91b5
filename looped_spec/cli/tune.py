"""`looped-spec tune`: measure a model's acceptance and pass costs and write its adaptive-speculation preset."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable
from pathlib import Path

from looped_spec.cli.common import UsageError, at_least, output_file, set_threads
from looped_spec.logs import LOG_LEVELS, configure_logging


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
        "eval, code, prose and humaneval are refused (looped_spec.tuning.prompt_sets)",
    )
    tune.add_argument("--out", required=True, help="preset JSON to write, e.g. presets/NAME.json (an existing file is "
                      "replaced)")  # fmt: skip
    tune.add_argument(
        "--grid",
        default="auto",
        help='auto (K 1..5 x d 1..D-1; d in 1,2,D/4,D/2,D-1 for D > 5) | full (K 1..8 x every d) | "K,d;K,d;..." '
        "(1 <= d < D; looped_spec.tuning.grid)",
    )
    tune.add_argument("--acceptance-tokens", type=int, default=96, help="greedy tokens per prompt (acceptance pass)")
    tune.add_argument("--num-prompts", type=int, default=32, help="prompts in the acceptance pass")
    tune.add_argument("--round-tokens", type=int, default=None,
                      help="generated tokens per request in the timed rounds (default: 32)")  # fmt: skip
    tune.add_argument(
        "--repeats", type=int, default=None, help="timed repeats, one more is run and dropped (default: 4)"
    )
    tune.add_argument(
        "--seed",
        type=int,
        default=None,
        help="seed of the timed rounds' interleaving order and of random token-id prompts (--prompts random, or a "
        "group on a model without a tokenizer) (default: 0)",
    )
    tune.add_argument(
        "--cost-from",
        default=None,
        metavar="PRESET",
        help="reuse this preset's (a file or shipped name, for the same model) measured cost profile instead of "
        "timing (re-derive after a rules change); the new preset keeps its hardware tag and timing machine "
        "(default: none, timed here)",
    )
    tune.add_argument("--hardware", default=None, help="hardware tag for the preset (default: cpu / GPU name; with "
                      "--cost-from: that preset's)")  # fmt: skip
    tune.add_argument(
        "--heatmap",
        nargs="?",
        const="",
        default=None,
        metavar="OUT.png",
        help="write predicted-speedup/acceptance heatmaps, in any format matplotlib writes (png, pdf, svg, ...) "
        "(default path: --out with .png)",
    )
    tune.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    tune.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    tune.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default), as generate "
                      "and serve take; the shipped presets were timed at 1, and the preset records it")  # fmt: skip
    tune.add_argument("--adapter-option", action="append", metavar="KEY=VALUE", help="passed to the adapter "
                      "(repeatable; default: no options)")  # fmt: skip
    tune.add_argument("--quiet", action="store_true", help="no progress bar")
    tune.add_argument("--log-level", default="warning", choices=LOG_LEVELS,
                      help="looped-spec's own log lines on stderr at this level and above (default: warning; info "
                      "adds the engines' startup lines)")  # fmt: skip
    tune.set_defaults(func=tune_command, argv=None, command_parser=tune)


def tune_command(args: argparse.Namespace) -> int:
    written: list[Path] = []
    try:
        return _tune(args, written)
    except KeyboardInterrupt:  # Ctrl-C: one line, no traceback; every file is written whole or not at all
        done = f"wrote {', '.join(map(str, written))}, nothing else" if written else "no preset written"
        print(f"looped-spec: interrupted; {done}", file=sys.stderr)
        return 130


def heatmap_file(value: str | None, out: Path) -> Path | None:
    """The --heatmap path (None: no heatmap), checked like --out before any work: another file than --out, in a
    format matplotlib writes."""
    if value is None:
        return None
    flag = "--heatmap" if value else "--heatmap (default: --out with .png)"
    path = output_file(value, "--heatmap") if value else out.with_suffix(".png")
    if path.resolve() == out.resolve():
        raise UsageError(f"{flag} {path}: is the --out file, which the heatmap would overwrite; give another path")
    try:
        from matplotlib.backend_bases import FigureCanvasBase
    except ImportError:
        raise UsageError("--heatmap needs matplotlib (pip install matplotlib)") from None
    formats = FigureCanvasBase.get_supported_filetypes()
    kind = path.suffix.lower().removeprefix(".")
    if kind not in formats:
        raise UsageError(f"{flag} {path}: matplotlib writes no {'.' + kind if kind else 'extension-less'} files; "
                         f"end it in one of {', '.join('.' + f for f in sorted(formats))}")  # fmt: skip
    return path


def write_output(path: Path, flag: str, write: Callable[[Path], object]) -> None:
    """`write(temporary path)`, then the temporary file renamed to `path`: an interrupted or failed write leaves no
    partial file. An OSError is a usage error naming the flag and the path."""
    import os
    import tempfile

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=path.suffix)
        os.close(fd)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(name, 0o666 & ~umask)  # as a file opened for writing gets (mkstemp's is private: 0600)
        try:
            write(Path(name))
            os.replace(name, path)
        except BaseException:
            Path(name).unlink(missing_ok=True)
            raise
    except OSError as exc:
        raise UsageError(f"{flag} {path}: cannot write it: {exc.strerror or exc}") from None


def _tune(args: argparse.Namespace, written: list[Path]) -> int:
    import shlex

    configure_logging(args.log_level)

    from looped_spec.models.adapter import resolve_model_path
    from looped_spec.models.checkpoint import read_config, resolve_dtype
    from looped_spec.presets.lookup import PresetError, is_for, load_preset, model_names, read_flagged_preset
    from looped_spec.tuning.grid import GridError, parse_prompt_source
    from looped_spec.tuning.inputs import parse_adapter_options
    from looped_spec.tuning.prompt_sets import GROUPS, has_tokenizer
    from looped_spec.tuning.report import dump_json, format_report, preset_data, write_heatmap
    from looped_spec.tuning.tuner import tune

    try:  # the benchmarks' parser: a group in any case (TUNE is the group, not a file named so), or a prompt file
        args.prompts = parse_prompt_source(args.prompts, "--prompts")
    except GridError as exc:
        raise UsageError(str(exc)) from None
    out = output_file(args.out, "--out")  # before measuring, which takes minutes
    heatmap = heatmap_file(args.heatmap, out)
    if args.hardware is not None and not args.hardware.strip():
        raise UsageError("--hardware '': is empty; give a tag such as cpu-2core, or leave it out")
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
    hardware = args.hardware
    cost = {}
    if args.cost_from:
        try:  # a file, or a shipped preset's name, as --preset takes
            source = read_flagged_preset(args.cost_from, "--cost-from")
        except PresetError as exc:
            raise UsageError(str(exc)) from None
        folder = resolve_model_path(args.model).resolve()
        config = read_config(folder)
        names = model_names(folder.name, folder, config)
        if not is_for(source.model, names):
            raise UsageError(f"--cost-from {args.cost_from}: its cost profile was measured on model "
                             f"{source.model!r}, not {names[0][0]!r} (omit --cost-from to measure it)")  # fmt: skip
        random_ids = args.prompts == "random" or (args.prompts in GROUPS and not has_tokenizer(folder))
        if args.seed is not None and not random_ids:
            raise UsageError(f"--seed: seeds the timed rounds, which --cost-from skips, and random token-id prompts, "
                             f"which --prompts {args.prompts} does not draw")  # fmt: skip
        # the profile is the source's measurement: the preset keeps where and how it was timed
        if hardware is not None and hardware != source.hardware:
            raise UsageError(f"--hardware {hardware}: --cost-from {args.cost_from}'s cost profile was timed on "
                             f"{source.hardware!r}, the tag the preset keeps (leave --hardware out)")  # fmt: skip
        hardware = source.hardware
        prov = source.provenance if isinstance(source.provenance, dict) else {}
        timed_on = prov.get("cost_machine") or prov.get("machine") or {}
        dtype = str(resolve_dtype(args.dtype, config, str(folder / "config.json")))
        if timed_on.get("dtype") and timed_on["dtype"] != dtype:
            timed_dtype, dtype = timed_on["dtype"].removeprefix("torch."), dtype.removeprefix("torch.")
            given = args.dtype if args.dtype == dtype else f"{args.dtype} ({dtype})"
            raise UsageError(
                f"--dtype {given}: --cost-from {args.cost_from}'s cost profile was timed in {timed_dtype}; give "
                f"--dtype {timed_dtype}, or omit --cost-from to time {dtype}"
            )
        cost = {
            "cost_profile": source.cost.model_dump(),
            "cost_report": prov.get("cost", {}),
            "cost_profile_source": f"from {args.cost_from}",
            "cost_measured": prov.get("cost_measured") or prov.get("date"),
            "cost_machine": timed_on,
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
        hardware=hardware,
        dtype=args.dtype,
        device=args.device,
        adapter_options=parse_adapter_options(args.adapter_option),
        seed=args.seed or 0,
        **cost,
        command="looped-spec " + shlex.join(argv),
        progress=not args.quiet,
    )
    data = preset_data(config)
    write_output(out, "--out", lambda tmp: tmp.write_text(dump_json(data), encoding="utf-8"))
    written.append(out)
    load_preset(config.model, config.full_depth, preset=out)  # re-read: what the engine will see
    print(format_report(report, data))
    print(f"wrote {out} in {time.perf_counter() - start:.1f} s")
    if heatmap is not None:
        title = f"{config.model} on {config.hardware}"
        write_output(heatmap, "--heatmap", lambda tmp: write_heatmap(report, tmp, title))
        written.append(heatmap)
        print(f"wrote {heatmap}")
    return 0
