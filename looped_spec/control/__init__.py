"""Adaptive-speculation control: which (K, d) each decode round runs. Pure logic on numbers (no model, no torch).

Per round the engine calls ``plan = controller.plan(batch_size, context, request_ids)``, runs the plan, commits, then
``controller.observe(feedback)`` (`plan.py`). docs/adaptive.md says what each module estimates or decides.
"""

from looped_spec.control.controller import AdaptiveController, FixedController, make_controller
from looped_spec.control.settings import ControlSettings

__all__ = [
    "AdaptiveController",
    "ControlSettings",
    "FixedController",
    "make_controller",
]
