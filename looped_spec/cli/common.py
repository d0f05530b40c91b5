"""What the `looped-spec` subcommands share: the engine flags and their options, usage errors, argument checks."""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from looped_spec.logs import LOG_LEVELS

API_KEY_ENV = "LOOPED_SPEC_API_KEY"

#: --cuda-graphs: EngineConfig.cuda_graphs (auto: on for CUDA, steps and loop passes alike)
CUDA_GRAPHS = {"auto": None, "on": True, "off": False, "emulate": "emulate"}


def engine_options(args: argparse.Namespace) -> dict:
    """LoopedSpecEngine keyword arguments from the shared engine flags (EngineConfig validates them; the command
    reports its errors by flag, cli/flag_errors.py)."""
    from looped_spec.tuning.inputs import parse_adapter_options

    options = dict(
        dtype=args.dtype, device=args.device, speculation=speculation_flag(args.speculation), preset=args.preset,
        policy=args.policy, seed=args.seed, trace_path=args.trace, max_batch_size=args.max_batch_size,
        max_model_len=args.max_model_len, early_exit=getattr(args, "early_exit", None) or "skip",
        batching=args.batching, cuda_graphs=CUDA_GRAPHS[args.cuda_graphs], prefix_caching=args.prefix_caching,
        adapter_options=parse_adapter_options(args.adapter_option) or None,
        max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
        num_kv_blocks=args.num_kv_blocks, kv_cache_memory_gb=args.kv_cache_memory_gb,
        max_pass_positions=args.max_pass_positions, scheduling_policy=args.scheduling_policy,
        control=json_object(args.control, "--control"),
    )  # fmt: skip
    if args.policy is None:  # not given: the engine's default (given, it must go with --speculation adaptive)
        del options["policy"]
    return options


def speculation_flag(text: str) -> str:
    """--speculation's value as the command line can spell it: off, adaptive or K,d (the engine checks K and d)."""
    parts = text.replace(" ", "").split(",")
    numbers = len(parts) == 2 and all(p.isascii() and p.isdigit() for p in parts)  # isdigit() alone takes "²"
    if text.strip().lower() in ("off", "adaptive") or numbers:
        return text
    raise UsageError(f"--speculation {text}: use off, adaptive or K,d (e.g. 3,1: draft 3 tokens with 1 loop)")


def json_object(text: str | None, option: str) -> dict | None:
    """A flag's JSON object (None when the flag is not given); a UsageError naming the flag otherwise."""
    if text is None:
        return None
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(f"{option}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(value, dict):
        raise UsageError(f"{option}: must be a JSON object, got {text!r:.60}")
    return value


def set_threads(threads: int) -> None:
    if threads:
        import torch

        try:
            torch.set_num_threads(threads)
        except ValueError as exc:  # past a C int: torch's "Overflow when unpacking long" names no flag
            raise UsageError(f"--threads {threads}: more than torch takes ({exc})") from None


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each flag's default, except None (the help text says what leaving the flag out means), an on/off
    switch's (off unless given) and one the help text states itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        switch = isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))
        if action.default is None or switch or "(default:" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


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


def add_engine_flags(p: argparse.ArgumentParser, command: str) -> None:
    """The engine flags of `generate` and `serve` (`command`: the help says what each does there). vLLM's engine
    arguments given to such a command are told what stands for them (cli/flag_errors.py)."""
    p.set_defaults(engine_flags=True)
    p.add_argument("--speculation", default="adaptive", help="off | adaptive | K,d (draft K tokens with d loops)")
    p.add_argument("--policy", default=None, choices=["goodput", "ema"],
                   help="adaptive speculation policy (only with --speculation adaptive; default: goodput)")  # fmt: skip
    p.add_argument("--preset", default=None, help="preset file or shipped preset name, only with --speculation "
                   "adaptive (default: the preset matched by the model's name)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0, help=SEED_HELP[command])
    p.add_argument("--max-batch-size", type=int, default=32, help="most requests decoded together")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="prompt + output limit in tokens (default: the model's max positions)")  # fmt: skip
    p.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16")
    p.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (0: torch's default); more than one collapses on a busy small box",
    )
    p.add_argument("--trace", default=None, metavar="FILE",
                   help="write the controller's JSONL trace here ("
                   + ("with --replicas one file per replica, stem.<replica id>.suffix; " if command == "serve" else "")
                   + "default: no trace)")  # fmt: skip
    p.add_argument("--batching", default="step", choices=["step", "loop"],
                   help="step: a decode step is a token (or speculative round) for the batch; loop: one loop pass "
                   "serves every request at its own loop")  # fmt: skip
    p.add_argument("--cuda-graphs", default="auto", choices=list(CUDA_GRAPHS),
                   help="auto: on for CUDA (captured steps and loop passes), off elsewhere; on: capture (an error "
                   "without CUDA); off: eager; emulate: the padded captured path run uncaptured, on any "
                   "device")  # fmt: skip
    p.add_argument("--adapter-option", action="append", default=None, metavar="KEY=VALUE",
                   help="passed to the adapter (repeatable; default: no options)")  # fmt: skip
    p.add_argument("--prefix-caching", action="store_true",
                   help="prompts that begin alike share the KV of that beginning (prefilled once)")  # fmt: skip
    p.add_argument("--log-level", default="info" if command == "serve" else "warning", choices=LOG_LEVELS,
                   help=LOG_LEVEL_HELP[command])  # fmt: skip
    memory = p.add_argument_group("KV cache and scheduling limits")
    memory.add_argument("--kv-cache-memory-gb", type=float, default=None, metavar="GIB",
                        help="memory for the KV cache in GiB, not with --num-kv-blocks (default: half the free GPU "
                        "memory on CUDA, 2 on CPU; never more than --max-batch-size requests of --max-model-len "
                        "need)")  # fmt: skip
    memory.add_argument("--num-kv-blocks", type=int, default=None, metavar="N",
                        help="KV cache blocks, instead of sizing them by memory (default: as "
                        "--kv-cache-memory-gb holds)")  # fmt: skip
    memory.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    memory.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=1024,
        help="most prompt tokens prefilled at once (in a prefill step; with --batching loop, in flight in the "
        "passes): a longer prompt is prefilled in chunks",
    )
    memory.add_argument("--max-pass-positions", type=int, default=None, metavar="N",
                        help="with --batching loop: most positions one loop pass runs, deepest work first "
                        "(default: every running request's work in every pass)")  # fmt: skip
    memory.add_argument("--scheduling-policy", default="fcfs", choices=["fcfs", "priority"],
                        help="which waiting request is admitted first and which running one is preempted first: "
                        "fcfs by arrival; priority by each request's priority (lower first), then arrival")  # fmt: skip
    memory.add_argument("--control", default=None, metavar="JSON",
                        help="the adaptive controller's tunables, a JSON object of ControlSettings fields such as "
                        '\'{"decision_interval": 8}\' (docs/adaptive.md "Tunables"); only with --speculation '
                        "adaptive (default: each tunable's documented default)")  # fmt: skip


SEED_HELP = {
    "serve": "random seed of the engine: a request without a seed of its own draws one from it",
    "generate": "random seed of every prompt, the same for all (so --batch-size copies of a prompt are the same text)",
}
LOG_LEVEL_HELP = {
    "serve": "level of the server's log: uvicorn's lines and looped-spec's own on stderr (the preset chosen and the "
    "engine's summary at startup, requests that fail)",
    "generate": "level of looped-spec's log lines on stderr (info: the preset chosen and the engine's summary); the "
    "generated text and the stats table on stdout are never mixed with them",
}


def one_line(exc: Exception) -> str:
    """A user error on one line: pydantic's errors as 'field: message', without its documentation URL."""
    errors = getattr(exc, "errors", None)
    if callable(errors) and type(exc).__name__ == "ValidationError":
        messages = [(e.get("loc"), e["msg"].removeprefix("Value error, ")) for e in exc.errors()]
        return "; ".join(f"{'.'.join(map(str, loc))}: {msg}" if loc else msg for loc, msg in messages)
    # a message of several lines (a preset file's errors, one a line) keeps them apart
    lines = [" ".join(line.split()) for line in str(exc).splitlines()]
    return "; ".join(line for line in lines if line) or type(exc).__name__
