"""Adaptive-speculation control: presets (data), policies (EMA thresholds, goodput) and controllers.

Per round the engine calls ``plan = controller.plan(num_running)``, runs the plan, commits, then
``controller.observe(feedback)``. Everything here is pure logic (no model code, no torch).
"""

from looped_spec.control.buckets import BucketTable, CompiledBucket, DisableSettings, compile_buckets
from looped_spec.control.controller import AdaptiveController, BaseController, FixedController, OffController
from looped_spec.control.costmodel import LinearFit2, RoundCostModel
from looped_spec.control.derive import derive_bucket, derive_preset, ideal_speedup
from looped_spec.control.goodput import DepthAcceptance, GoodputPolicy, expected_accept_rate, expected_tokens
from looped_spec.control.policy import BucketState, CandidatePolicy, Policy
from looped_spec.control.presets import (
    AdaptiveSpecConfig,
    BucketConfig,
    CandidateConfig,
    DisableConfig,
    PresetError,
    generic_preset,
    list_presets,
    load_preset,
    match_preset_name,
    preset_dir,
    read_preset_file,
)
from looped_spec.control.simulate import SyntheticWorkload
from looped_spec.control.trace import TraceWriter

__all__ = [
    "AdaptiveController",
    "AdaptiveSpecConfig",
    "BaseController",
    "BucketConfig",
    "BucketState",
    "BucketTable",
    "CandidateConfig",
    "CandidatePolicy",
    "CompiledBucket",
    "DepthAcceptance",
    "DisableConfig",
    "DisableSettings",
    "FixedController",
    "GoodputPolicy",
    "LinearFit2",
    "OffController",
    "Policy",
    "PresetError",
    "RoundCostModel",
    "SyntheticWorkload",
    "TraceWriter",
    "compile_buckets",
    "derive_bucket",
    "derive_preset",
    "expected_accept_rate",
    "expected_tokens",
    "generic_preset",
    "ideal_speedup",
    "list_presets",
    "load_preset",
    "match_preset_name",
    "preset_dir",
    "read_preset_file",
]
