"""Presets: finding and reading preset files (`load_preset`, `generic_preset`, `read_preset_file`).

The schema itself (`AdaptiveSpecConfig` and its parts, `PresetError`) lives in `schema.py` and is
re-exported here, so ``from looped_spec.control.presets import AdaptiveSpecConfig, load_preset`` works.

Shipped presets live in the `looped_spec.presets` package (the repository's `presets/` folder), one
`<name>.json` per model. A model is matched to a preset by its checkpoint folder name, lower-cased:
first exactly (``"Ouro-1.4B"`` -> ``ouro-1.4b.json``), then by the longest preset name that is a prefix
followed by ``-``, ``_`` or ``.`` (``"Ouro-1.4B-Thinking"`` -> ``ouro-1.4b.json``); otherwise the
family-generic ``default.json`` is rescaled to the model's depth (see `schema.py`, depth rule "scale").
YAML files (``.yaml`` / ``.yml``) are read only when PyYAML is importable.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

from looped_spec.control.schema import (
    AdaptiveSpecConfig,
    BucketConfig,
    CandidateConfig,
    DisableConfig,
    PresetError,
    format_validation_error,
)

__all__ = [
    "AdaptiveSpecConfig",
    "BucketConfig",
    "CandidateConfig",
    "DisableConfig",
    "PresetError",
    "format_validation_error",
    "generic_preset",
    "list_presets",
    "load_preset",
    "match_preset_name",
    "preset_dir",
    "read_preset_file",
    "shipped_preset_path",
]

PRESET_PACKAGE = "looped_spec.presets"
GENERIC_PRESET = "default"
_SUFFIXES = (".json", ".yaml", ".yml")


def preset_dir() -> Path:
    """Folder of the shipped preset files."""
    return Path(str(resources.files(PRESET_PACKAGE)))


def list_presets() -> list[str]:
    """Names (file stems) of the shipped presets, sorted."""
    return sorted(p.stem for p in preset_dir().iterdir() if p.suffix in _SUFFIXES)


def shipped_preset_path(name: str) -> Path | None:
    """The shipped file for preset `name` (case-insensitive, without suffix), or None."""
    folder = preset_dir()
    for suffix in _SUFFIXES:
        path = folder / f"{name.lower()}{suffix}"
        if path.is_file():
            return path
    return None


def _read_data(path: Path) -> Any:
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".yaml", ".yml"):
        try:
            import yaml  # type: ignore[import-untyped]
        except ImportError:
            raise PresetError(f"{path}: reading YAML presets needs PyYAML (pip install pyyaml)") from None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError as err:
            raise PresetError(f"{path}: invalid YAML: {err}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise PresetError(f"{path}: invalid JSON: {err}") from None


def read_preset_file(path: str | Path) -> AdaptiveSpecConfig:
    """Parse and validate one preset file; every error line starts with the file's path."""
    path = Path(path)
    if not path.is_file():
        raise PresetError(f"{path}: preset file not found")
    return AdaptiveSpecConfig.parse(_read_data(path), source=str(path))


def match_preset_name(model_name: str) -> str | None:
    """Shipped preset name for a checkpoint folder / hub id like "ByteDance/Ouro-1.4B", or None."""
    stem = Path(str(model_name).rstrip("/\\")).name.lower()
    names = [n for n in list_presets() if n != GENERIC_PRESET]
    if stem in names:
        return stem
    prefixes = [n for n in names if stem.startswith(n) and stem[len(n) : len(n) + 1] in ("-", "_", ".")]
    return max(prefixes, key=len) if prefixes else None


def _checked(config: AdaptiveSpecConfig, full_depth: int, source: str) -> AdaptiveSpecConfig:
    errors = config.depth_errors(full_depth)
    if errors:
        raise PresetError("\n".join(f"{source}: {line}" for line in errors))
    return config.for_depth(full_depth)


def generic_preset(full_depth: int) -> AdaptiveSpecConfig:
    """The family-generic preset (`default.json`) rescaled to depth `full_depth` (any D >= 1)."""
    path = shipped_preset_path(GENERIC_PRESET)
    if path is None:
        raise PresetError(f"{preset_dir()}: the generic preset {GENERIC_PRESET}.json is missing")
    return _checked(read_preset_file(path), full_depth, str(path))


def load_preset(
    model_name: str, full_depth: int, preset: str | Path | AdaptiveSpecConfig | None = None
) -> AdaptiveSpecConfig:
    """The preset to serve `model_name` (a checkpoint folder or name) of loop depth `full_depth` with.

    `preset` wins when given: a config object, a file path, or the name of a shipped preset. Otherwise
    the shipped preset matching the folder name, else the generic default for that depth. The result is
    validated for (or, with depth rule "scale", rescaled to) `full_depth`; errors name the file.
    """
    if isinstance(preset, AdaptiveSpecConfig):
        return _checked(preset, full_depth, f"preset for {preset.model!r}")
    if preset is not None:
        path = Path(preset)
        if not path.is_file():
            shipped = shipped_preset_path(str(preset)) if path.suffix not in _SUFFIXES else None
            if shipped is None:
                shipped_names = ", ".join(list_presets())
                raise PresetError(f"{path}: no such preset file or shipped preset (shipped: {shipped_names})")
            path = shipped
        return _checked(read_preset_file(path), full_depth, str(path))
    name = match_preset_name(model_name)
    if name is None:
        return generic_preset(full_depth)
    path = shipped_preset_path(name)
    assert path is not None
    return _checked(read_preset_file(path), full_depth, str(path))
