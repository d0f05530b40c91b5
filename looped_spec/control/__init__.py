"""Adaptive-speculation control: presets (data), policies (EMA thresholds, goodput) and controllers.

Per round the engine calls ``plan = controller.plan(num_running, context, remaining)`` (context: the batch's
mean tokens in the KV per request; remaining: the requests' token budgets left, when nothing waits), runs the
plan, commits, then ``controller.observe(feedback)``. Everything here is pure logic (no model code, no torch).

Exported here is what a user of presets and controllers needs: the preset schema, reading and choosing
presets, and the three controllers. The parts behind them (policies, acceptance and cost models, the
tuner's derivation rules, the workload simulator) are imported from their modules, e.g.
``from looped_spec.control.goodput import GoodputPolicy``.
"""

from looped_spec.control.controller import AdaptiveController, FixedController, OffController
from looped_spec.control.presets import find_preset, load_preset, read_preset_file
from looped_spec.control.schema import AdaptiveSpecConfig, BucketConfig, CandidateConfig, DisableConfig, PresetError

__all__ = [
    "AdaptiveController",
    "AdaptiveSpecConfig",
    "BucketConfig",
    "CandidateConfig",
    "DisableConfig",
    "FixedController",
    "OffController",
    "PresetError",
    "find_preset",
    "load_preset",
    "read_preset_file",
]
