"""Shared benchmark plumbing: one loaded model and its engines (`Bench`, for bench_plain.py and
bench_early_exit.py, which time them in bench_speculative.py's interleaved rounds), the checks of the flags several
benchmarks share, made before any model loads or any round is timed (`check_model`, `check_preset`,
`check_prompt_source`, `check_grid_entries`, `check_out_path`), and the refusal to evaluate a preset on the prompts it
was tuned on (`refuse_tuning_prompts`).

Prompts (the groups, random token ids, files: `load_prompts`, `random_prompts`) live in
`looped_spec.tuning.prompt_sets`, and batch sizes and the (K, d) grid are parsed by `looped_spec.tuning.grid`, for
every benchmark and the tuner alike; bench_speculative.py times configurations interleaved (its `interleaved_rounds`,
`timed_slices`, `spread`), and the other benchmarks reuse that.

A check raises a ValueError whose message names the flag; a script turns it into its usage error
(``parser.error``: exit status 2, no traceback).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

from looped_spec import LoopedSpecEngine, load_adapter
from looped_spec.models.adapter import resolve_model_path
from looped_spec.models.checkpoint import CheckpointError
from looped_spec.presets.lookup import read_flagged_preset
from looped_spec.presets.schema import PresetError
from looped_spec.tuning.grid import parse_grid
from looped_spec.tuning.prompt_sets import (
    PromptSetError,
    check_disjoint,
    is_prompt_file,
    prompt_fingerprints,
    provenance_fingerprints,
    read_prompt_file,
)


class Bench:
    """Engine configurations on one adapter in one process, so ratios compare like with like."""

    def __init__(self, model: str, dtype: str = "float32", device: str = "cpu", **adapter_options) -> None:
        self.adapter = load_adapter(model, dtype=dtype, device=device, **adapter_options)

    def engine(self, speculation, **kwargs) -> LoopedSpecEngine:
        kwargs.setdefault("max_batch_size", 64)
        return LoopedSpecEngine(self.adapter, speculation=speculation, **kwargs)


# ----------------------------------------------------------------------------------------- flags, checked up front
def check_model(model: str, flag: str = "--model") -> None:
    """A checkpoint folder or a shipped model name (`resolve_model_path`); its weights are read later, by the script."""
    try:
        resolve_model_path(model)
    except CheckpointError as exc:
        raise ValueError(f"{flag} {exc}") from None


def check_preset(preset: str | None, flag: str = "--preset") -> None:
    """A preset file or a shipped preset's name that reads and validates (`read_preset_file`); None: the model's own.
    Whether it fits the model (its family, its depth) is the engine's to say once the model is loaded."""
    if preset is None:
        return
    try:
        read_flagged_preset(preset, flag)
    except PresetError as exc:
        raise ValueError(str(exc)) from None


def check_prompt_source(source: str, where: str = "--prompts") -> None:
    """A prompt file (a group is checked by its flag's parser, `looped_spec.tuning.grid.parse_prompt_source`) must read
    and hold at least one prompt. `where` (the flag, or the flag and its entry) starts the message: without this,
    `load_prompts` finds an empty file only after the model loaded, and names --prompts whatever flag gave it.
    Token ids are checked against the vocabulary when the prompts load (the model's vocabulary is not known yet)."""
    if not is_prompt_file(source):
        return
    try:
        prompts = read_prompt_file(source)
    except PromptSetError as exc:  # names the file (and the line)
        raise ValueError(f"{where}: {exc}") from None
    if not prompts:
        raise ValueError(f"{where}: {source} holds no prompts (blank lines are skipped)")


def check_grid_entries(spec: str, flag: str = "--grid", *, allow_none: bool = False) -> None:
    """The entries of a ``"K,d;K,d"`` grid (`parse_grid`), checked before the model is loaded: all but d < D, which
    needs the model's depth D and is checked by `parse_grid` once it is known. ``auto`` and ``full`` need D only."""
    if spec.strip().lower() not in ("auto", "full"):
        parse_grid(spec, sys.maxsize, flag=flag, allow_none=allow_none)


def check_out_path(path: str | Path, flag: str = "--out") -> None:
    """A file the script can write at its end (its missing folders are made then): not a folder, under a folder one
    may write in. Checked up front, so a typo does not cost the run's results."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory; give the file to write")
    folder = path.parent
    while not folder.exists() and folder != folder.parent:  # the nearest existing folder: the rest is made in it
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is not a directory")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: cannot write in {folder}")


def load_model(parser, model: str, **kwargs) -> Any:
    """`load_adapter`, a checkpoint that does not load being a usage error naming --model (`check_model` only
    resolved the name)."""
    try:
        return load_adapter(model, **kwargs)
    except CheckpointError as exc:
        parser.error(f"--model {exc}")


# ----------------------------------------------------------------------------------------- tuning prompts
def refuse_tuning_prompts(name: str, preset: Any, prompts: list[Any]) -> bool:
    """Exit with status 2 when `preset` (an `AdaptiveSpecConfig`) was tuned on any of the evaluation `prompts` (its
    provenance["prompts"]["fingerprints"]): a preset scored on its own tuning prompts looks better than it is. True
    when checked; False (said in a note) when the preset records no tuning prompts. `name` is what runs it."""
    fingerprints = provenance_fingerprints(preset.provenance)
    if fingerprints is None:
        print(
            f"note: the preset of {name} ({preset.model}) records no tuning-prompt fingerprints "
            "(provenance['prompts']['fingerprints']); overlap with the evaluation prompts not checked"
        )
        return False
    try:
        check_disjoint(fingerprints, prompts)
    except PromptSetError as exc:
        print(f"error: {name} (preset {preset.model}): {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    print(
        f"{name}: preset {preset.model} was tuned on {len(set(fingerprints))} prompts; "
        f"none of the {len(set(prompt_fingerprints(prompts)))} evaluation prompts is among them"
    )
    return True
