"""`looped-spec` command line: generate text with a shipped or local looped model, serve it, or tune its preset."""

from __future__ import annotations

import argparse
import os
import sys

from looped_spec.cli import generate, serve, tune
from looped_spec.cli.common import HelpFormatter, UsageError, one_line
from looped_spec.cli.flag_errors import flags_of, name_flags, unrecognized
from looped_spec.cli.generate import speed_ratio

__all__ = ["build_parser", "main", "speed_ratio"]


def build_parser() -> argparse.ArgumentParser:
    from looped_spec import __version__

    fmt = HelpFormatter
    parser = argparse.ArgumentParser(prog="looped-spec", description=__doc__, formatter_class=fmt)
    parser.add_argument("--version", action="version", version=f"looped-spec {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in (generate, serve, tune):
        command.add_parser(sub, fmt)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # argparse's error, saying what stands for vLLM's flags and what a misspelt one was likely meant to be
        command = getattr(args, "command_parser", parser)
        engine_flags = getattr(args, "engine_flags", False)
        command.error(unrecognized(unknown, command, engine_flags=engine_flags, serve=args.command == "serve"))
    if args.command == "tune":
        args.argv = list(argv) if argv is not None else sys.argv[1:]
    try:
        return args.func(args)
    except BrokenPipeError:  # the reader went away (`| head`): not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # no second error when Python flushes stdout
        return 0
    except UsageError as exc:  # names its flags already
        print(f"looped-spec: error: {one_line(exc)}", file=sys.stderr)
        return 2
    except (ValueError, TypeError) as exc:  # the engine's and SamplingParams' errors name fields: say the flags
        flags = flags_of(args.command_parser)  # the subcommand's own parser (set_defaults)
        message = name_flags(one_line(exc), flags)
        model = getattr(args, "model", None)
        if model is not None and message.startswith(f"{model}: "):  # the loader names the path or name it was given
            message = f"--model {message}"
        print(f"looped-spec: error: {message}", file=sys.stderr)
        return 2
    except (KeyError, OSError) as exc:
        print(f"looped-spec: error: {one_line(exc)}", file=sys.stderr)
        return 2
