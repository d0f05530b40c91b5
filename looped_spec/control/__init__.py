"""Adaptive-speculation control: which (K, d) each decode round runs. Pure logic on numbers (no model, no torch).

Per round the engine calls ``plan = controller.plan(batch_size, context)``, runs the plan, commits, then
``controller.observe(feedback)`` (`plan.py`). The adaptive controller reads a preset (`schema.py`, `presets.py`),
prices plans by passes (`passcost.py`) and acceptance (`acceptance.py`, `exits.py`), and lets a policy choose:
`goodput.py` (the default) or `ema.py`. Its tunables are in `settings.py`.
"""

from looped_spec.control.controller import AdaptiveController, FixedController, make_controller
from looped_spec.control.presets import find_preset, load_preset, read_preset_file
from looped_spec.control.schema import AdaptiveSpecConfig, BucketConfig, CandidateConfig, DisableConfig, PresetError
from looped_spec.control.settings import ControlSettings

__all__ = [
    "AdaptiveController",
    "AdaptiveSpecConfig",
    "BucketConfig",
    "CandidateConfig",
    "ControlSettings",
    "DisableConfig",
    "FixedController",
    "PresetError",
    "find_preset",
    "load_preset",
    "make_controller",
    "read_preset_file",
]
