"""Adaptive-speculation control: presets (data), policies (EMA thresholds, goodput) and controllers.

Per round the engine calls ``plan = controller.plan(num_running)``, runs the plan, commits, then
``controller.observe(feedback)``. Everything here is pure logic (no model code, no torch).
"""

from looped_spec.control.acceptance import AcceptanceModel, markov_accept_rate, markov_tokens, simulate_tokens
from looped_spec.control.controller import AdaptiveController, BaseController, FixedController, OffController
from looped_spec.control.costprofile import CostProfile
from looped_spec.control.derive import BucketModel, derive_buckets, derive_preset
from looped_spec.control.goodput import DepthAcceptance, GoodputPolicy, expected_accept_rate, expected_tokens
from looped_spec.control.policy import CandidatePolicy, Policy
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
    read_preset_file,
)
from looped_spec.control.simulate import SyntheticWorkload

__all__ = [
    "AcceptanceModel",
    "AdaptiveController",
    "AdaptiveSpecConfig",
    "BaseController",
    "BucketConfig",
    "BucketModel",
    "CandidateConfig",
    "CandidatePolicy",
    "CostProfile",
    "DepthAcceptance",
    "DisableConfig",
    "FixedController",
    "GoodputPolicy",
    "OffController",
    "Policy",
    "PresetError",
    "SyntheticWorkload",
    "derive_buckets",
    "derive_preset",
    "expected_accept_rate",
    "expected_tokens",
    "generic_preset",
    "list_presets",
    "load_preset",
    "markov_accept_rate",
    "markov_tokens",
    "match_preset_name",
    "read_preset_file",
    "simulate_tokens",
]
