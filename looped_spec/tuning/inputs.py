"""Tuner inputs: batch sizes, the (K, d) grid, prompts (built-in, file or random ids), machine facts."""

from __future__ import annotations

import json
import os
import platform
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from looped_spec.models.adapter import ModelAdapter

BUILTIN_CODE_PROMPTS = (  # each ends where the body starts, so a code model writes code, not blank lines
    'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same backwards."""\n    ',
    'def flatten(items):\n    """Flatten a list of lists into one list."""\n    result = []\n    ',
    'def count_words(path):\n    """Count how often each word occurs in the file at path."""\n    ',
    'def merge_dicts(a, b):\n    """Return a new dict with the keys of a and b; b wins."""\n    ',
    'def parse_version(text):\n    """Split a version string like \'1.2.3\' into a tuple of ints."""\n    ',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n        ',
    'def read_config(filename):\n    """Read key=value lines from filename into a dict."""\n    ',
    'def chunks(seq, size):\n    """Yield successive chunks of length size from seq."""\n    for i in ',
    'def gcd(a, b):\n    """Return the greatest common divisor of a and b."""\n    while ',
    'def unique(items):\n    """Return the items without duplicates, keeping their order."""\n    ',
    'def to_snake_case(name):\n    """Convert a CamelCase name to snake_case."""\n    ',
    'def binary_search(values, target):\n    """Return the index of target in the sorted list values, or -1."""\n    ',
)
BUILTIN_PROSE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog, and then",
    "In the morning the town was quiet; the baker opened his shop and",
    "A good function does one thing, and it does it well. For example,",
    "The river ran past the old mill, where",
)


class TunerError(ValueError):
    """Bad tuner input (grid, batch sizes, prompts); the CLI exits with status 2."""


# ----------------------------------------------------------------------------------------- inputs
def parse_batch_sizes(spec: str | Sequence[int]) -> list[int]:
    """Parse "1,8,32" or [1, 8, 32] -> sorted distinct positive batch sizes."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    try:
        sizes = sorted({int(str(x).strip()) for x in items if str(x).strip()})
    except ValueError:
        raise TunerError(f"--batch-sizes {spec!r}: expected comma-separated integers like 1,8,32") from None
    if not sizes or sizes[0] < 1:
        raise TunerError(f"--batch-sizes {spec!r}: need at least one batch size, all >= 1")
    return sizes


def auto_grid(depth: int) -> list[tuple[int, int]]:
    """K in 1..5 times d in 1..D-1 (d in {1, 2, D/4, D/2, D-1} when D > 5)."""
    ds = range(1, depth) if depth <= 5 else sorted({d for d in (1, 2, depth // 4, depth // 2, depth - 1) if d >= 1})
    return [(k, d) for k in range(1, 6) for d in ds]


def parse_grid(spec: str | Sequence[tuple[int, int]], depth: int) -> list[tuple[int, int]]:
    """'auto' or 'K,d;K,d;...' (or pairs) -> distinct cells; every entry is checked against depth D."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        grid = auto_grid(depth)
        if not grid:
            raise TunerError(f"--grid auto: the model has full depth D={depth}; self-speculation needs D >= 2")
        return grid
    entries = [e.strip() for e in spec.split(";") if e.strip()] if isinstance(spec, str) else list(spec)
    if not entries:
        raise TunerError(f"--grid {spec!r}: no entries; use 'auto' or 'K,d;K,d'")
    grid: list[tuple[int, int]] = []
    for entry in entries:
        text = entry if isinstance(entry, str) else ",".join(map(str, entry))
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 2 or not all(p.lstrip("-").isdigit() for p in parts):
            raise TunerError(f"--grid entry {text!r}: expected 'K,d' with integers K and d")
        k, d = int(parts[0]), int(parts[1])
        if not 1 <= k <= 64:
            raise TunerError(f"--grid entry {text!r}: K={k} must be in 1..64 (plain decoding is always measured)")
        if not 1 <= d < depth:
            raise TunerError(f"--grid entry {text!r}: d={d} must be in 1..{depth - 1} (d < full depth D={depth})")
        if (k, d) not in grid:
            grid.append((k, d))
    return grid


def parse_adapter_options(items: Sequence[str] | None) -> dict[str, Any]:
    """["key=value", ...] -> options; values parse as JSON scalars where they can (3, 0.5, true), else strings."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TunerError(f"--adapter-option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def has_tokenizer(path: str | None) -> bool:
    """True when the checkpoint folder carries tokenizer files (the engine then accepts text prompts)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return path is not None and any((Path(path) / n).is_file() for n in names)


def random_token_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token-id prompts of 8..23 tokens (ids 3..vocab-1 where the vocabulary allows)."""
    rng = random.Random(seed)
    low = 3 if vocab_size > 3 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def load_prompts(source: str | Sequence[Any], adapter: ModelAdapter, count: int) -> tuple[list[Any], str]:
    """`count` prompts (cycled) and a description.

    `source`: "tune" (the tuning prompt group of `looped_spec.tuning.prompt_sets`: built-in prompts and held-out
    standard-library snippets, disjoint from the "eval" group), "builtin", a .txt (one prompt a line) /
    .jsonl file, or a list. A model without a tokenizer gets random token-id prompts for "tune"/"builtin".
    """
    if isinstance(source, str) and source == "tune" and has_tokenizer(adapter.path):
        from looped_spec.tuning.prompt_sets import prompt_group

        base = list(prompt_group("tune"))
        what = f"tune group: {len(base)} prompts (built-in + held-out stdlib half A; disjoint from the eval group)"
    elif isinstance(source, str) and source in ("builtin", "tune"):
        if has_tokenizer(adapter.path):
            base: list[Any] = list(BUILTIN_CODE_PROMPTS + BUILTIN_PROSE_PROMPTS)
            n_code, n_prose = len(BUILTIN_CODE_PROMPTS), len(BUILTIN_PROSE_PROMPTS)
            what = f"builtin: {n_code} Python function headers + {n_prose} English sentences"
        else:
            base = random_token_prompts(max(count, 1), adapter.vocab_size)
            what = f"builtin: {len(base)} random token-id prompts (seed 0; the model has no tokenizer)"
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise TunerError(f"--prompts {source}: not 'tune' or 'builtin' and no such file")
        base = _read_prompt_file(path)
        what = f"file {path} ({len(base)} prompts)"
    else:
        base = list(source)
        what = f"{len(base)} prompts given by the caller"
    if not base:
        raise TunerError(f"--prompts {source}: no prompts")
    return [base[i % len(base)] for i in range(count)], what


def prompt_fingerprints(prompts: Sequence[Any]) -> list[str]:
    """Distinct fingerprints of the prompts (stored in a tuned preset, checked by the benchmark)."""
    from looped_spec.tuning.prompt_sets import prompt_fingerprints as fingerprints

    return sorted(set(fingerprints(prompts)))


def _read_prompt_file(path: Path) -> list[Any]:
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise TunerError(f"{path}:{n}: expected a JSON object with a 'prompt' field") from None
    return prompts


def hardware_tag(device: torch.device) -> str:
    """'cpu', or the GPU's name as a tag like 'nvidia-h100-80gb-hbm3'."""
    if device.type == "cuda":
        return "-".join(torch.cuda.get_device_name(device).lower().split())
    return device.type


def machine_info(adapter: ModelAdapter) -> dict[str, Any]:
    """Where the numbers were measured."""
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(adapter.device),
        "dtype": str(adapter.dtype),
    }
    if adapter.device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(adapter.device)
    return info
