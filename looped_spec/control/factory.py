"""Engine-facing construction of the per-round plan source from the `speculation=` argument."""

from __future__ import annotations

from typing import Any

from looped_spec.plan import RoundFeedback, SpeculationPlan
from looped_spec.sampling_params import SpeculativeConfig


class StaticPlanController:
    """Hands out the same (K, d) every round; K = 0 is plain decoding ("off")."""

    def __init__(self, k: int = 0, d: int = 0, measure_depths: bool = False) -> None:
        self.k, self.d, self.measure_depths = k, d, measure_depths
        self._next_id = 0

    def plan(self, num_running: int) -> SpeculationPlan:
        self._next_id += 1
        return SpeculationPlan(self._next_id, self.k, self.d, measure_depths=self.measure_depths)

    def observe(self, feedback: RoundFeedback) -> None:
        pass

    def close(self) -> None:
        pass


def parse_speculation(speculation: Any) -> Any:
    """'off' | 'adaptive' | 'K,d' | SpeculativeConfig | dict -> 'off' | 'adaptive' | SpeculativeConfig."""
    if speculation is None:
        return "off"
    if isinstance(speculation, SpeculativeConfig):
        return speculation
    if isinstance(speculation, dict):
        return SpeculativeConfig(**speculation)
    if isinstance(speculation, str):
        text = speculation.strip().lower()
        if text in ("off", "adaptive"):
            return text
        parts = text.replace(" ", "").split(",")
        if len(parts) == 2 and all(p.isdigit() for p in parts):
            return SpeculativeConfig(k=int(parts[0]), d=int(parts[1]))
    raise ValueError(f"speculation={speculation!r}: use 'off', 'adaptive', 'K,d' or SpeculativeConfig(k=..., d=...)")


def make_controller(speculation: Any, adapter, *, preset=None, policy: str = "ema", trace_path=None):
    """Build the controller the engine asks for a plan every decode round."""
    spec = parse_speculation(speculation)
    depth = adapter.full_depth
    if spec == "off":
        return StaticPlanController(0, 0)
    if isinstance(spec, SpeculativeConfig):
        if spec.k > 0 and not 1 <= spec.d < depth:
            raise ValueError(f"speculation.d={spec.d} must be in 1..{depth - 1} (full depth D={depth})")
        return StaticPlanController(spec.k, spec.d if spec.k else 0, spec.measure_depths)
    from looped_spec.control.controller import AdaptiveController
    from looped_spec.control.presets import load_preset

    config = load_preset(adapter.name, depth, preset)
    return AdaptiveController(config, depth, policy=policy, trace_path=trace_path)
