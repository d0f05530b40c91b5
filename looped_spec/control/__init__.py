"""Adaptive-speculation control: which (K, d) each decode round runs. Pure logic on numbers (no model, no torch).

Per round the engine calls ``plan = controller.plan(batch_size, context)``, runs the plan, commits, then
``controller.observe(feedback)`` (`plan.py`). The adaptive controller reads a preset (`looped_spec.presets`),
prices plans by passes (`passcost.py`) and acceptance (`acceptance.py`, `exits.py`), and lets a policy choose:
`goodput.py` (the default) or `ema.py`. Its tunables are in `settings.py`.
"""

from looped_spec.control.controller import AdaptiveController, FixedController, make_controller
from looped_spec.control.settings import ControlSettings

__all__ = [
    "AdaptiveController",
    "ControlSettings",
    "FixedController",
    "make_controller",
]
