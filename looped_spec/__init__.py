"""looped-spec: serve looped (recurrent-depth) language models with adaptive self-speculative decoding.

The public names are imported on first use (PEP 562), so `import looped_spec` and `looped-spec --help`
do not pay for importing torch.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING

__version__ = "0.1.0"

_EXPORTS = {
    "CheckpointError": "looped_spec.models.checkpoint",
    "CompletionOutput": "looped_spec.request",
    "EngineConfig": "looped_spec.engine.config",
    "KVLayout": "looped_spec.execution.kv_cache",
    "LoopedSpecEngine": "looped_spec.engine.engine",
    "AsyncLoopedSpecEngine": "looped_spec.engine.async_engine",
    "ModelAdapter": "looped_spec.models.adapter",
    "RequestMetrics": "looped_spec.request",
    "RequestOutput": "looped_spec.request",
    "RoundFeedback": "looped_spec.control.plan",
    "SamplingParams": "looped_spec.sampling_params",
    "SpeculationPlan": "looped_spec.control.plan",
    "SpeculativeConfig": "looped_spec.engine.config",
    "StructuredOutputs": "looped_spec.structured_output",
    "TensorSpec": "looped_spec.models.checkpoint",
    "TextPrompt": "looped_spec.engine.inputs",
    "TokensPrompt": "looped_spec.engine.inputs",
    "load_adapter": "looped_spec.models.adapter",
    "register_adapter": "looped_spec.models.adapter",
    "registered_model_types": "looped_spec.models.adapter",
}
__all__ = [
    "AsyncLoopedSpecEngine",
    "CheckpointError",
    "CompletionOutput",
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
    "StructuredOutputs",
    "TensorSpec",
    "TextPrompt",
    "TokensPrompt",
    "load_adapter",
    "register_adapter",
    "registered_model_types",
]

if TYPE_CHECKING:
    from looped_spec.control.plan import RoundFeedback, SpeculationPlan
    from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
    from looped_spec.engine.config import EngineConfig, SpeculativeConfig
    from looped_spec.engine.engine import LoopedSpecEngine
    from looped_spec.engine.inputs import TextPrompt, TokensPrompt
    from looped_spec.models.adapter import ModelAdapter, load_adapter, register_adapter, registered_model_types
    from looped_spec.models.checkpoint import CheckpointError, TensorSpec
    from looped_spec.models.kv_layout import KVLayout
    from looped_spec.request import CompletionOutput, RequestMetrics, RequestOutput
    from looped_spec.sampling_params import SamplingParams
    from looped_spec.structured_output import StructuredOutputs


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'looped_spec' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(list(globals()) + __all__)
