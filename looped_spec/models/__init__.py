"""Tiny looped checkpoints shipped with looped-spec, addressable by short name (e.g. 'tiny-ouro')."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).parent


def shipped_models() -> dict[str, Path]:
    """Short name -> folder of every shipped checkpoint."""
    return {p.name: p for p in sorted(_HERE.iterdir()) if (p / "config.json").is_file()}


def shipped_model_path(name: str) -> Path | None:
    return shipped_models().get(name)
