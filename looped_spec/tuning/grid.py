"""Batch sizes, the (K, d) grid and workload phases: the one parser of the tuner and every benchmark.

The (K, d) grid (`parse_grid`, the ``--grid`` flag of `looped-spec tune` and of the benchmarks):

- ``auto``: K in 1..5 x d in 1..D-1, or d in {1, 2, D/4, D/2, D-1} when D > 5 (`auto_grid`). The tuner's grid
  and the benchmarks' default (older result files may record an ``auto`` of another meaning: docs/benchmarking.md
  "One grid, one prompt loader").
- ``full``: K in 1..8 x every d in 1..D-1 (`full_grid`): a larger screen for a benchmark that wants every depth
  and longer drafts (D = 4: 24 cells; D = 8: 56).
- ``none`` (only where the caller allows no cells, e.g. a benchmark of plain vs adaptive only): no cells.
- ``"K,d;K,d;..."``: those cells, 1 <= K <= 64 and 1 <= d < D, in the order given, repeats dropped.

Batch sizes (`parse_batch_sizes`): ``"1,8,32"`` -> sorted distinct sizes >= 1. Ordered integer lists
(`parse_int_list`, e.g. ``--exit-at-steps``) keep their order and repeats. Workload phases (`parse_phases`,
``--workload-phases``): ``B`` or ``B:GROUP`` per phase, e.g. ``8:eval,8:code,32:prose,8:eval``; a phase
without a group decodes the benchmark's ``--prompts``. A prompt source (`parse_prompt_source`, ``--prompts`` and a
phase's GROUP) is a group or a prompt file of one's own (``.txt``: a prompt a line; ``.jsonl``: a ``"prompt"`` a line),
e.g. ``--workload-phases 8:eval,8:my-code.jsonl``.

Every error is a `GridError` (a `TunerError`, so a ValueError) that names the flag and the bad entry, e.g.
``--grid entry '1,4': d=4 must be in 1..3 (d < full depth D=4)``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NamedTuple

from looped_spec.tuning.inputs import TunerError
from looped_spec.tuning.prompt_sets import EVALUATION_SOURCES, PROMPT_FILE_KINDS, is_prompt_file

MAX_K = 64  # the largest draft length a grid cell may ask for
AUTO_K = range(1, 6)
FULL_K = range(1, 9)


class GridError(TunerError):
    """A bad batch-size list, (K, d) grid or workload phase; the message names the flag and the entry."""


class Phase(NamedTuple):
    """One workload phase: its batch size and the prompt group it decodes."""

    batch: int
    group: str


def auto_depths(depth: int) -> list[int]:
    """The draft depths of the ``auto`` grid: 1..D-1, or {1, 2, D/4, D/2, D-1} when D > 5."""
    if depth <= 5:
        return list(range(1, depth))
    return sorted({d for d in (1, 2, depth // 4, depth // 2, depth - 1) if d >= 1})


def auto_grid(depth: int) -> list[tuple[int, int]]:
    """K in 1..5 times d in 1..D-1 (d in {1, 2, D/4, D/2, D-1} when D > 5)."""
    return [(k, d) for k in AUTO_K for d in auto_depths(depth)]


def full_grid(depth: int) -> list[tuple[int, int]]:
    """K in 1..8 times every d in 1..D-1."""
    return [(k, d) for k in FULL_K for d in range(1, depth)]


def parse_grid(
    spec: str | Sequence[tuple[int, int]], depth: int, *, flag: str = "--grid", allow_none: bool = False
) -> list[tuple[int, int]]:
    """``auto``, ``full``, ``none`` (when `allow_none`) or ``"K,d;K,d"`` (or (K, d) pairs) -> distinct cells,
    every one checked against the full depth D; errors name `flag` and the entry."""
    if isinstance(spec, str):
        word = spec.strip().lower()
        if word in ("auto", "full"):
            grid = auto_grid(depth) if word == "auto" else full_grid(depth)
            if not grid:
                raise GridError(f"{flag} {word}: the model has full depth D={depth}; self-speculation needs D >= 2")
            return grid
        if word == "none" and allow_none:
            return []
        entries: list = [e.strip() for e in spec.split(";") if e.strip()]
    else:
        entries = list(spec)
    if not entries:
        if allow_none:
            return []
        raise GridError(f"{flag} {spec!r}: no entries; use 'auto', 'full' or 'K,d;K,d'")
    grid: list[tuple[int, int]] = []
    for entry in entries:
        text = entry if isinstance(entry, str) else ",".join(map(str, entry))
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 2 or not all(p.lstrip("-").isdigit() for p in parts):
            raise GridError(f"{flag} entry {text!r}: expected 'K,d' with integers K and d")
        k, d = int(parts[0]), int(parts[1])
        if not 1 <= k <= MAX_K:
            raise GridError(f"{flag} entry {text!r}: K={k} must be in 1..{MAX_K} (plain decoding is always measured)")
        if not 1 <= d < depth:
            raise GridError(f"{flag} entry {text!r}: d={d} must be in 1..{depth - 1} (d < full depth D={depth})")
        if (k, d) not in grid:
            grid.append((k, d))
    return grid


def parse_int_list(spec: str | Sequence[int], flag: str, *, minimum: int = 1) -> list[int]:
    """``"1,8,32"`` (or ints) -> the integers in order, repeats kept, each >= `minimum`; at least one."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    values = []
    for item in items:
        text = str(item).strip()
        if not text:
            continue
        try:
            value = int(text)
        except ValueError:
            raise GridError(f"{flag} entry {text!r}: expected an integer (e.g. {flag} 1,8,32)") from None
        if value < minimum:
            raise GridError(f"{flag} entry {text!r}: must be >= {minimum}")
        values.append(value)
    if not values:
        raise GridError(f"{flag} {spec!r}: need at least one value, e.g. {flag} 1,8,32")
    return values


def parse_batch_sizes(spec: str | Sequence[int], flag: str = "--batch-sizes") -> list[int]:
    """``"1,8,32"`` or [1, 8, 32] -> sorted distinct batch sizes, all >= 1."""
    return sorted(set(parse_int_list(spec, flag)))


def parse_phases(
    spec: str, default_group: str, flag: str = "--workload-phases", groups: Sequence[str] = EVALUATION_SOURCES
) -> list[Phase]:
    """``"1,8,32,8,1"`` or ``"8:eval,8:code,32:prose"`` -> one `Phase` per entry, in order.

    An entry is ``B`` (a batch size >= 1; the phase decodes `default_group`) or ``B:GROUP``, GROUP one of
    `groups` (the prompt sources a benchmark evaluates on: `prompt_sets.EVALUATION_SOURCES`) or a prompt file
    (`parse_prompt_source`; its path may hold no comma).
    """
    phases = []
    for item in spec.split(","):
        text = item.strip()
        if not text:
            continue
        size, sep, group = (part.strip() for part in text.partition(":"))
        if sep and not group:
            raise GridError(f"{flag} entry {text!r}: expected B or B:GROUP, a group after the colon")
        try:
            batch = int(size)
        except ValueError:
            raise GridError(f"{flag} entry {text!r}: expected B or B:GROUP with an integer batch size B") from None
        if batch < 1:
            raise GridError(f"{flag} entry {text!r}: batch size {batch} must be >= 1")
        group = parse_prompt_source(group, f"{flag} entry {text!r}:", groups) if sep else default_group
        phases.append(Phase(batch, group))
    if not phases:
        raise GridError(f"{flag} {spec!r}: need at least one phase, e.g. {flag} 1,8:code,32:prose")
    return phases


def parse_prompt_source(text: str, where: str = "--prompts:", groups: Sequence[str] = EVALUATION_SOURCES) -> str:
    """A prompt group of `groups` (any case), or a prompt file's path as given (.txt or .jsonl; read, and checked,
    when loaded: `prompt_sets.load_prompts`). `where` (the flag, and the entry) starts the error's message."""
    name = text.strip()
    if is_prompt_file(name):
        return name
    if name.lower() in groups:
        return name.lower()
    files = " or ".join(PROMPT_FILE_KINDS)
    problem = f"unknown prompt group {name!r}; use one of {', '.join(groups)}, or a {files} prompt file"
    raise GridError(f"{where} {problem}" if where else problem)


def prompt_source_flag(text: str) -> str:
    """`parse_prompt_source` as an argparse ``type=`` (argparse names the flag in its usage error)."""
    try:
        return parse_prompt_source(text, "")
    except GridError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
