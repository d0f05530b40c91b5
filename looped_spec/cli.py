"""`looped-spec` command line: generate text with a shipped or local looped model, or tune its preset."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

API_KEY_ENV = "LOOPED_SPEC_API_KEY"


#: --cuda-graphs: EngineConfig.cuda_graphs (auto: on for CUDA, steps and loop passes alike)
CUDA_GRAPHS = {"auto": None, "on": True, "off": False, "emulate": "emulate"}


def _engine_options(args: argparse.Namespace) -> dict:
    """LoopedSpecEngine keyword arguments from the shared engine flags."""
    from looped_spec.tuning.inputs import parse_adapter_options

    return dict(dtype=args.dtype, device=args.device, speculation=args.speculation, preset=args.preset,
                policy=args.policy, seed=args.seed, trace_path=args.trace, max_batch_size=args.max_batch_size,
                max_model_len=args.max_model_len, early_exit=getattr(args, "early_exit", "skip"),
                batching=args.batching, cuda_graphs=CUDA_GRAPHS[args.cuda_graphs],
                adapter_options=parse_adapter_options(args.adapter_option) or None)  # fmt: skip


def _set_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


def _read_prompts(args: argparse.Namespace) -> list[str | list[int]]:
    """--prompt values, then the lines of --prompts-file (`-` = stdin; .jsonl: a "prompt" field per line, text or
    token ids)."""
    prompts: list[str | list[int]] = list(args.prompt or [])
    if args.prompts_file:
        if args.prompts_file == "-":
            name, lines = "<stdin>", sys.stdin.read().splitlines()
        else:
            name = args.prompts_file
            try:
                lines = Path(name).read_text(encoding="utf-8").splitlines()
            except (OSError, UnicodeDecodeError) as exc:
                raise UsageError(f"--prompts-file {name}: {getattr(exc, 'strerror', None) or exc}") from None
        for n, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            if name.endswith(".jsonl"):
                try:
                    line = json.loads(line)["prompt"]
                except (json.JSONDecodeError, KeyError, TypeError):
                    raise ValueError(f"{name}:{n}: expected a JSON object with a 'prompt' field") from None
                ids = isinstance(line, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in line)
                if not isinstance(line, str) and not ids:
                    raise ValueError(f"{name}:{n}: 'prompt' must be text or a list of token ids, got {line!r:.60}")
            prompts.append(line)
    if not prompts:
        raise ValueError("no prompt: give --prompt TEXT or --prompts-file FILE (- for stdin)")
    return prompts * args.batch_size


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
    if args.compare_repeats is not None and not args.compare_plain:
        raise UsageError("--compare-repeats: only with --compare-plain")
    args.compare_repeats = 5 if args.compare_repeats is None else args.compare_repeats
    _at_least(args.compare_repeats, 1, "--compare-repeats")
    _at_least(args.threads, 0, "--threads", " (0: torch's default)")
    _set_threads(args.threads)
    prompts = _read_prompts(args)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k,
                            top_p=args.top_p, seed=args.seed, ignore_eos=args.ignore_eos, stop=args.stop or [],
                            exit_threshold=args.exit_threshold, exit_at_step=args.exit_at_step)  # fmt: skip
    engine = LoopedSpecEngine(args.model, **_engine_options(args))
    try:
        if args.stream:
            outputs = _stream(engine, prompts, params)
        else:
            outputs = engine.generate(prompts, params)
            for i, (prompt, out) in enumerate(zip(prompts, outputs)):
                if len(outputs) > 1:
                    print(f"--- output {i} ---")
                print(_as_text(prompt) + (out.text if out.text is not None else _as_text(out.token_ids)))
        _print_stats(engine, args, outputs)
    finally:
        engine.close()
    if args.compare_plain:
        _compare_plain(args, prompts, params, outputs)
    return 0


def _as_text(tokens: str | list[int]) -> str:
    """Text as it is; token ids (a model without a tokenizer, or ids given) as a space-separated list."""
    return tokens if isinstance(tokens, str) else " ".join(map(str, tokens)) + " "


def _stream(engine, prompts: list[str | list[int]], params) -> list:
    """Print each prompt's tokens as they are committed (prompts run one after another)."""
    outputs = []
    for i, prompt in enumerate(prompts):
        request_id = engine.add_request(prompt, params)  # checked before anything is printed
        if len(prompts) > 1:
            print(f"--- output {i} ---")
        print(_as_text(prompt), end="", flush=True)
        while engine.has_unfinished_requests():
            for out in engine.step():
                print(out.new_text if engine.tokenizer is not None else _as_text(out.new_token_ids), end="",
                      flush=True)  # fmt: skip
                if out.finished and out.request_id == request_id:
                    outputs.append(out)
        print()
    return outputs


def _print_stats(engine, args: argparse.Namespace, outputs: list) -> None:
    stats = engine.stats
    num_tokens = sum(len(o.token_ids) for o in outputs)
    reasons = Counter(o.finish_reason for o in outputs)
    rows = [
        ("model", f"{engine.adapter.name} ({engine.adapter.model_type}, D={engine.adapter.full_depth})"),
        ("speculation", str(args.speculation)),
        ("requests", str(len(outputs))),
        ("tokens generated", str(num_tokens)),
        ("finish reasons", ", ".join(f"{r}: {n}" for r, n in sorted(reasons.items()))),
    ]
    if stats.num_loop_passes:  # loop-level batching: passes, not rounds
        occupancy = stats.num_loop_pass_positions / stats.num_loop_passes
        rows.append(("loop passes (positions per pass)", f"{stats.num_loop_passes} ({occupancy:.2f})"))
        if stats.num_draft_tokens:
            accepted = f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} ({100 * stats.acceptance_rate:.1f}%)"
            rows.append(("draft tokens accepted", accepted))
    else:
        rows += [
            ("decode rounds", f"{stats.num_rounds} ({stats.num_spec_rounds} speculative)"),
            ("tokens per round", f"{(num_tokens - len(outputs)) / max(stats.num_rounds, 1):.2f}"),
            ("draft tokens accepted",
             f"{stats.num_accepted_tokens}/{stats.num_draft_tokens} ({100 * stats.acceptance_rate:.1f}%)"),
            ("plans used (K,d: rounds)", ", ".join(f"{k}: {v}" for k, v in sorted(stats.plan_histogram.items()))),
        ]  # fmt: skip
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


def _compare_plain(args: argparse.Namespace, prompts: list[str], params, outputs: list) -> None:
    """The same prompts with and without speculation, side by side: one persistent engine each, whole runs in
    alternating order, repeated, the first pair dropped (warm-up); the median of the pairs' wall-time ratios."""
    import statistics

    from looped_spec import LoopedSpecEngine
    from looped_spec.control.controller import DEFAULT_POLICY

    spec = LoopedSpecEngine(args.model, **_engine_options(args) | {"trace_path": None})
    # plain decoding runs no adaptive controller: its preset and policy are not options there
    off = {"speculation": "off", "trace_path": None, "preset": None, "policy": DEFAULT_POLICY}
    plain = LoopedSpecEngine(args.model, **_engine_options(args) | off)
    ratios, same = [], True
    try:
        for i in range(args.compare_repeats + 1):
            seconds = {}
            for name, engine in (("spec", spec), ("plain", plain))[:: 1 if i % 2 == 0 else -1]:
                start = time.perf_counter()
                runs = engine.generate(prompts, params)
                seconds[name] = time.perf_counter() - start
                same = same and all(a.token_ids == b.token_ids for a, b in zip(runs, outputs))
            if i:
                ratios.append(seconds["plain"] / seconds["spec"])
    finally:
        spec.close()
        plain.close()
    print(f"{'vs plain decoding':<24}  {speed_ratio(statistics.median(ratios))} [{min(ratios):.2f}-{max(ratios):.2f}] "
          f"(median of {len(ratios)} side-by-side pairs, wall time incl. prefill; outputs "
          f"{'identical' if same else 'differ'})")  # fmt: skip
    if params.temperature == 0.0 and not same:
        print("looped-spec: warning: greedy speculative output differs from plain decoding", file=sys.stderr)


def speed_ratio(ratio: float) -> str:
    """'1.57x faster', or '0.73x as fast (slower)': never 'faster' for a slowdown."""
    return f"{ratio:.2f}x faster" if ratio >= 1.0 else f"{ratio:.2f}x as fast (slower)"


def _serve(args: argparse.Namespace) -> int:
    from looped_spec import LoopedSpecEngine
    from looped_spec.server.launch import serve

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    scaling = dict(num_replicas=args.replicas, min_replicas=args.min_replicas, max_replicas=args.max_replicas,
                   target_ongoing_requests=args.target_ongoing_requests, metrics_port=args.metrics_port)  # fmt: skip
    _at_least(args.threads, 0, "--threads", " (0: torch's default)")
    if not 0 <= args.port <= 65535:
        raise UsageError(f"--port {args.port}: must be in 0..65535")
    _at_least(args.max_queued, 0, "--max-queued")
    _at_least(args.max_body_bytes, 1, "--max-body-bytes")
    if any(value is not None for value in scaling.values()):
        return _serve_replicas(args, api_key, scaling)
    _set_threads(args.threads)
    engine = LoopedSpecEngine(args.model, **_engine_options(args))
    name = args.served_model_name or Path(str(args.model)).name
    serve(engine, name, host=args.host, port=args.port, api_key=api_key, max_queued=args.max_queued,
          max_body_bytes=args.max_body_bytes, log_level=args.log_level)  # fmt: skip
    return 0


_REPLICA_FLAGS = {"num_replicas": "--replicas", "min_replicas": "--min-replicas", "max_replicas": "--max-replicas",
                  "target_ongoing_requests": "--target-ongoing-requests", "metrics_port": "--metrics-port"}  # fmt: skip


def _serve_replicas(args: argparse.Namespace, api_key: str | None, scaling: dict) -> int:
    """`serve` with replicas: the same app under Ray Serve, one engine per replica (server/replicas.py)."""
    try:
        from looped_spec.server.replicas import ReplicaAppArgs, parse_args, run_replicas
    except ImportError as exc:
        raise UsageError(f"--replicas needs Ray Serve ({exc}): pip install -e '.[ray]'") from None
    options = _engine_options(args)
    options = {key: value for key, value in options.items() if value is not None}  # JSON-able, defaults left out
    if options.get("dtype") is not None:
        options["dtype"] = str(options["dtype"])
    given = {key: value for key, value in scaling.items() if value is not None}
    try:
        app_args: ReplicaAppArgs = parse_args(dict(model=str(args.model), served_model_name=args.served_model_name,
                                                   api_key=api_key, max_queued=args.max_queued,
                                                   max_body_bytes=args.max_body_bytes, threads=args.threads,
                                                   engine=options, **given))  # fmt: skip
        app_args.check_before_start()
    except ValueError as exc:  # name the flags, not the application's fields
        message = str(exc).removeprefix("looped-spec application args: ").removeprefix("engine: ")
        for field, flag in _REPLICA_FLAGS.items():
            message = message.replace(field, flag)
        raise UsageError(message) from None
    run_replicas(app_args, args.host, args.port)
    return 0


def _models(args: argparse.Namespace) -> int:
    from looped_spec.models import shipped_models

    for name, path in shipped_models().items():
        print(f"{name}\t{path}")
    return 0


def _tune(args: argparse.Namespace) -> int:
    import shlex

    from looped_spec.models.adapter import resolve_model_path
    from looped_spec.models.checkpoint import read_config
    from looped_spec.presets.lookup import is_for, load_preset, model_names, read_preset_file, shipped_preset_path
    from looped_spec.tuning.inputs import parse_adapter_options
    from looped_spec.tuning.report import dump_json, format_report, preset_data, write_heatmap
    from looped_spec.tuning.tuner import tune

    out = _output_file(args.out, "--out")  # before measuring, which takes minutes
    if args.heatmap:
        _output_file(args.heatmap, "--heatmap")
    if args.heatmap is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--heatmap needs matplotlib (pip install matplotlib)") from None
    _at_least(args.threads, 0, "--threads", " (0: torch's default)")
    _at_least(args.acceptance_tokens, 2, "--acceptance-tokens", " (the first token comes from prefill)")
    timing = {"round_tokens": 32, "repeats": 4}  # the timed rounds' defaults; no rounds are timed with --cost-from
    for option, default in timing.items():
        flag = "--" + option.replace("_", "-")
        if args.cost_from and getattr(args, option) is not None:
            raise UsageError(f"{flag}: times rounds, which --cost-from skips (it reuses a measured profile)")
        setattr(args, option, default if getattr(args, option) is None else getattr(args, option))
    _at_least(args.round_tokens, 2, "--round-tokens")
    for option in ("num_prompts", "repeats"):
        _at_least(getattr(args, option), 1, "--" + option.replace("_", "-"))
    _set_threads(args.threads)
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


def _add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculation", default="adaptive", help="off | adaptive | K,d (draft K tokens with d loops)")
    p.add_argument("--policy", default="goodput", choices=["goodput", "ema"],
                   help="adaptive speculation policy (only with --speculation adaptive)")  # fmt: skip
    p.add_argument("--preset", default=None, help="preset file or shipped preset name; none: matched by model name "
                   "(only with --speculation adaptive)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="engine seed (and the per-request seed of generate)")
    p.add_argument("--max-batch-size", type=int, default=32, help="most requests decoded together")
    p.add_argument("--max-model-len", type=int, default=None, help="prompt + output limit; none: the model's")
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's default); more than one collapses on a busy small box",
    )
    p.add_argument("--trace", default=None, help="write the controller's JSONL trace here")
    p.add_argument("--batching", default="step", choices=["step", "loop"],
                   help="step: a decode step is a token (or speculative round) for the batch; loop: one loop pass "
                   "serves every request at its own loop")  # fmt: skip
    p.add_argument("--cuda-graphs", default="auto", choices=list(CUDA_GRAPHS),
                   help="auto: captured steps and loop passes on CUDA; on: capture (an error where it cannot); "
                   "off: eager; emulate: the padded captured path run uncaptured, on any device")  # fmt: skip
    p.add_argument("--adapter-option", action="append", metavar="KEY=VALUE", help="passed to the adapter (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    from looped_spec import __version__

    fmt = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="looped-spec", description=__doc__, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"looped-spec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser(
        "generate",
        help="generate continuations and print speculation stats",
        formatter_class=fmt,
        description="Generate a continuation of every prompt and print speculation stats.",
    )
    gen.add_argument("--model", default="tiny-ouro", help="checkpoint folder or shipped model name")
    gen.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    gen.add_argument(
        "--prompts-file",
        default=None,
        metavar="FILE",
        help="more prompts, one a line (.jsonl: a 'prompt' field a line; '-': stdin)",
    )
    gen.add_argument("--max-tokens", type=int, default=64, help="most tokens generated per prompt")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    gen.add_argument("--top-k", type=int, default=0, help="0 or -1 = no top-k filtering")
    gen.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass")
    gen.add_argument("--stop", action="append", help="stop string (repeatable; cut from the output)")
    gen.add_argument("--ignore-eos", action="store_true", help="keep generating past the eos token")
    gen.add_argument("--exit-threshold", type=float, default=None, help="early exit: the family rule's threshold")
    gen.add_argument("--exit-at-step", type=int, default=None, help="early exit: fixed loop depth per token")
    gen.add_argument("--early-exit", default="skip", choices=["skip", "select"], help="how early exit runs")
    gen.add_argument("--batch-size", type=int, default=1, help="run the prompt(s) this many times together")
    gen.add_argument("--stream", action="store_true", help="print tokens as they come (prompts one after another)")
    gen.add_argument(
        "--compare-plain",
        action="store_true",
        help="also time the prompts with and without speculation side by side and print the ratio",
    )
    gen.add_argument("--compare-repeats", type=int, default=None,
                     help="side-by-side pairs --compare-plain times; none: 5")  # fmt: skip
    _add_engine_flags(gen)
    gen.set_defaults(func=_generate)
    srv = sub.add_parser(
        "serve",
        help="serve an OpenAI-compatible HTTP API",
        formatter_class=fmt,
        description="Serve /v1/completions, /v1/chat/completions, /v1/models, /health and "
        "/metrics with FastAPI + uvicorn. /health and /metrics need no API key.",
    )
    srv.add_argument("model", nargs="?", default="tiny-ouro", help="checkpoint folder or shipped model name")
    srv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes the server)")
    srv.add_argument("--port", type=int, default=8000, help="TCP port")
    srv.add_argument(
        "--api-key", default=None, help=f"require 'Authorization: Bearer KEY' on /v1/* (default: ${API_KEY_ENV} if set)"
    )
    srv.add_argument("--served-model-name", default=None, help="model id in the API (default: folder name)")
    srv.add_argument(
        "--max-queued",
        type=int,
        default=256,
        help="requests that may wait beyond the running batch; more get 429 + Retry-After",
    )
    srv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="larger request bodies get 413")
    ray_flags = srv.add_argument_group("replicas (Ray Serve; pip install -e '.[ray]')")
    ray_flags.add_argument("--replicas", type=int, default=None, help="serve with this many engine replicas behind "
                           "Ray Serve's proxy (on CUDA one GPU each; RAY_ADDRESS joins a running cluster)")  # fmt: skip
    ray_flags.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    ray_flags.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas")
    ray_flags.add_argument("--target-ongoing-requests", type=float, default=None,
                           help="autoscaling: in-flight requests per replica it aims at")  # fmt: skip
    ray_flags.add_argument("--metrics-port", type=int, default=None,
                           help="replica r also serves its /metrics on port + r (labelled by replica)")  # fmt: skip
    srv.add_argument("--early-exit", default="skip", choices=["skip", "select"],
                     help="how requests' exit_threshold / exit_at_step run (with or without speculation)")  # fmt: skip
    srv.add_argument(
        "--log-level",
        default="info",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn log level",
    )
    _add_engine_flags(srv)
    srv.set_defaults(func=_serve)
    models = sub.add_parser("models", help="list the shipped tiny models", formatter_class=fmt)
    models.set_defaults(func=_models)
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
    tune.set_defaults(func=_tune, argv=None)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "tune":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 0
    except (ValueError, KeyError, TypeError, OSError) as exc:
        print(f"looped-spec: error: {_one_line(exc)}", file=sys.stderr)
        return 2


def _one_line(exc: Exception) -> str:
    """A user error on one line: pydantic's errors as 'field: message', without its documentation URL."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        messages = [(e.get("loc"), e["msg"].removeprefix("Value error, ")) for e in exc.errors()]
        return "; ".join(f"{'.'.join(map(str, loc))}: {msg}" if loc else msg for loc, msg in messages)
    return " ".join(str(exc).split()) or type(exc).__name__


if __name__ == "__main__":
    sys.exit(main())
