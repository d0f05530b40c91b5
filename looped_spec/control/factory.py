"""Engine-facing construction of the per-round plan source from the `speculation=` argument."""

from __future__ import annotations

from typing import Any

from looped_spec.control.controller import DEFAULT_POLICY, AdaptiveController, FixedController, OffController
from looped_spec.control.presets import load_preset
from looped_spec.engine.config import SpeculativeConfig, parse_speculation


def make_controller(speculation: Any, adapter, *, preset=None, policy: str = DEFAULT_POLICY, trace_path=None):
    """Build the controller the engine asks for a plan every decode round.

    A model of depth 1 has nothing to draft with, so "adaptive" falls back to plain decoding there.
    """
    spec = parse_speculation(speculation)
    depth = adapter.full_depth
    if spec == "off" or (spec == "adaptive" and depth < 2):
        return OffController(trace_path=trace_path)
    if isinstance(spec, SpeculativeConfig):
        if spec.k > 0 and not 1 <= spec.d < depth:
            raise ValueError(f"speculation.d={spec.d} must be in 1..{depth - 1} (full depth D={depth})")
        return FixedController(spec.k, spec.d, depth, trace_path=trace_path, measure_depths=spec.measure_depths)
    config = load_preset(adapter.name, depth, preset, folder=adapter.path, config=adapter.config)
    return AdaptiveController(config, depth, policy=policy, trace_path=trace_path)
