"""Presets: the shipped per-model preset files (`*.json`, data), their format (`schema.py`, pydantic) and how a
model's preset is found and fitted to its depth (`lookup.py`). The tuner writes them; the controller reads them."""

from looped_spec.presets.lookup import find_preset, list_presets, load_preset, preset_for, read_preset_file
from looped_spec.presets.schema import AdaptiveSpecConfig, BucketConfig, CandidateConfig, DisableConfig, PresetError

__all__ = [
    "AdaptiveSpecConfig",
    "BucketConfig",
    "CandidateConfig",
    "DisableConfig",
    "PresetError",
    "find_preset",
    "list_presets",
    "load_preset",
    "preset_for",
    "read_preset_file",
]
