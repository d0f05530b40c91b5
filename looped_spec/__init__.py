"""looped-spec: serve looped (recurrent-depth) language models with adaptive self-speculative decoding."""

from looped_spec.adapter import KVLayout, ModelAdapter, load_adapter, register_adapter, registered_model_types
from looped_spec.checkpoint import CheckpointError, TensorSpec
from looped_spec.engine import LoopedSpecEngine
from looped_spec.plan import RoundFeedback, SpeculationPlan
from looped_spec.request import RequestMetrics, RequestOutput
from looped_spec.sampling_params import SamplingParams, SpeculativeConfig

__all__ = [
    "CheckpointError",
    "KVLayout",
    "LoopedSpecEngine",
    "RequestMetrics",
    "RequestOutput",
    "RoundFeedback",
    "SamplingParams",
    "SpeculationPlan",
    "SpeculativeConfig",
    "ModelAdapter",
    "TensorSpec",
    "load_adapter",
    "register_adapter",
    "registered_model_types",
]
__version__ = "0.1.0"
