"""looped-spec: serve looped (recurrent-depth) language models with adaptive self-speculative decoding.

The public names are imported on first use (PEP 562), so `import looped_spec` and `looped-spec --help`
do not pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointError": "looped_spec.checkpoint",
    "EngineConfig": "looped_spec.engine_config",
    "KVLayout": "looped_spec.kv_cache",
    "LoopedSpecEngine": "looped_spec.engine",
    "AsyncLoopedSpecEngine": "looped_spec.async_engine",
    "ModelAdapter": "looped_spec.model_adapter",
    "RequestMetrics": "looped_spec.request",
    "RequestOutput": "looped_spec.request",
    "RoundFeedback": "looped_spec.plan",
    "SamplingParams": "looped_spec.sampling_params",
    "SpeculationPlan": "looped_spec.plan",
    "SpeculativeConfig": "looped_spec.engine_config",
    "TensorSpec": "looped_spec.checkpoint",
    "load_adapter": "looped_spec.model_adapter",
    "register_adapter": "looped_spec.model_adapter",
    "registered_model_types": "looped_spec.model_adapter",
}
__all__ = [
    "AsyncLoopedSpecEngine",
    "CheckpointError",
    "EngineConfig",
    "KVLayout",
    "LoopedSpecEngine",
    "ModelAdapter",
    "RequestMetrics",
    "RequestOutput",
    "RoundFeedback",
    "SamplingParams",
    "SpeculationPlan",
    "SpeculativeConfig",
    "TensorSpec",
    "load_adapter",
    "register_adapter",
    "registered_model_types",
]

if TYPE_CHECKING:
    from looped_spec.async_engine import AsyncLoopedSpecEngine
    from looped_spec.checkpoint import CheckpointError, TensorSpec
    from looped_spec.engine import LoopedSpecEngine
    from looped_spec.engine_config import EngineConfig, SpeculativeConfig
    from looped_spec.kv_cache import KVLayout
    from looped_spec.model_adapter import ModelAdapter, load_adapter, register_adapter, registered_model_types
    from looped_spec.plan import RoundFeedback, SpeculationPlan
    from looped_spec.request import RequestMetrics, RequestOutput
    from looped_spec.sampling_params import SamplingParams


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'looped_spec' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
