"""What the `looped-spec` subcommands share: the engine flags and their options, usage errors, argument checks."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

API_KEY_ENV = "LOOPED_SPEC_API_KEY"

#: --cuda-graphs: EngineConfig.cuda_graphs (auto: on for CUDA, steps and loop passes alike)
CUDA_GRAPHS = {"auto": None, "on": True, "off": False, "emulate": "emulate"}


def engine_options(args: argparse.Namespace) -> dict:
    """LoopedSpecEngine keyword arguments from the shared engine flags."""
    from looped_spec.tuning.inputs import parse_adapter_options

    return dict(dtype=args.dtype, device=args.device, speculation=args.speculation, preset=args.preset,
                policy=args.policy, seed=args.seed, trace_path=args.trace, max_batch_size=args.max_batch_size,
                max_model_len=args.max_model_len, early_exit=getattr(args, "early_exit", "skip"),
                batching=args.batching, cuda_graphs=CUDA_GRAPHS[args.cuda_graphs], prefix_caching=args.prefix_caching,
                adapter_options=parse_adapter_options(args.adapter_option) or None)  # fmt: skip


def set_threads(threads: int) -> None:
    if threads:
        import torch

        torch.set_num_threads(threads)


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None: the help text says what leaving the flag out means."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        return action.help if action.default is None else super()._get_help_string(action)


class UsageError(ValueError):
    """Bad command-line input: reported as one line, exit status 2."""


def output_file(value: str, option: str) -> Path:
    """A path a command will write: not empty, not a directory, not under an existing file, and in a folder that
    takes a new file. Checked before any work."""
    if not value.strip():
        raise UsageError(f"{option} {value!r}: is empty; give a file path")
    path = Path(value)
    if path.is_dir():
        raise UsageError(f"{option} {value}: is a directory; give a file path")
    for parent in path.parents:
        if parent.exists():
            if not parent.is_dir():
                raise UsageError(f"{option} {value}: {parent} is a file, not a directory")
            if not os.access(parent, os.W_OK) or not _takes_new_files(parent):
                raise UsageError(f"{option} {value}: cannot write in {parent}")
            break
    return path


def _takes_new_files(folder: Path) -> bool:
    """Whether a file can be created in `folder`: tried, since `os.access` says yes to root on /proc or /sys and
    on a read-only mount."""
    import tempfile

    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=".looped-spec-probe-"):
            return True
    except OSError:
        return False


def at_least(value: int, minimum: int, option: str, note: str = "") -> None:
    if value < minimum:
        raise UsageError(f"{option} {value}: must be >= {minimum}{note}")


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--speculation", default="adaptive", help="off | adaptive | K,d (draft K tokens with d loops)")
    p.add_argument("--policy", default="goodput", choices=["goodput", "ema"],
                   help="adaptive speculation policy (only with --speculation adaptive)")  # fmt: skip
    p.add_argument("--preset", default=None, help="preset file or shipped preset name; none: matched by model name "
                   "(only with --speculation adaptive)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help="random seed: the engine's, from which a request without a "
                   "seed draws one (generate: also every prompt's seed, the same for all)")  # fmt: skip
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
    p.add_argument("--prefix-caching", action="store_true",
                   help="prompts that begin alike share the KV of that beginning (prefilled once)")  # fmt: skip


def one_line(exc: Exception) -> str:
    """A user error on one line: pydantic's errors as 'field: message', without its documentation URL."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        messages = [(e.get("loc"), e["msg"].removeprefix("Value error, ")) for e in exc.errors()]
        return "; ".join(f"{'.'.join(map(str, loc))}: {msg}" if loc else msg for loc, msg in messages)
    return " ".join(str(exc).split()) or type(exc).__name__
