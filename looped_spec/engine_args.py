"""LoopedSpecEngine's constructor arguments, validated at the boundary with errors that name the argument."""

from __future__ import annotations

import math
import os
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, ValidationError, field_validator

from looped_spec.adapter import ModelAdapter


class EngineArgs(BaseModel):
    """Types and ranges of the engine's scalar arguments. Strict: `max_batch_size="8"` is an error, not 8."""

    model_config = ConfigDict(extra="forbid", arbitrary_types_allowed=True, frozen=True)

    model: Any
    dtype: str | torch.dtype
    device: str | torch.device
    max_batch_size: StrictInt = Field(ge=1)
    max_model_len: StrictInt | None = Field(ge=2)
    adapter_options: dict[str, Any] | None
    seed: StrictInt = Field(ge=0)
    preset: Any
    policy: Literal["goodput", "ema"]
    trace_path: str | os.PathLike | None
    block_size: StrictInt = Field(ge=1, le=1 << 16)
    num_kv_blocks: StrictInt | None = Field(ge=1)
    kv_cache_memory_gb: float | None
    max_num_batched_tokens: StrictInt = Field(ge=1)
    cuda_graphs: StrictBool | Literal["emulate"] | None
    early_exit: Literal["skip", "select"]

    @field_validator("model")
    @classmethod
    def _model(cls, value: Any) -> Any:
        if not isinstance(value, (str, os.PathLike, ModelAdapter)):
            raise ValueError(
                f"must be a checkpoint folder, a shipped model name or a ModelAdapter, got {type(value).__name__}"
            )
        return value

    @field_validator("preset")
    @classmethod
    def _preset(cls, value: Any) -> Any:
        from looped_spec.control.schema import AdaptiveSpecConfig

        if value is not None and not isinstance(value, (str, os.PathLike, AdaptiveSpecConfig)):
            raise ValueError(
                f"must be a preset file, a shipped preset name or an AdaptiveSpecConfig, got {type(value).__name__}"
            )
        return value

    @field_validator("kv_cache_memory_gb", mode="before")
    @classmethod
    def _memory(cls, value: Any) -> Any:
        if value is None:
            return value
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"must be a finite number of GiB > 0, got {value!r}")
        return value


def check_engine_args(**kwargs: Any) -> EngineArgs:
    """Validate; a bad value raises ValueError naming the argument (one line per problem)."""
    try:
        return EngineArgs(**kwargs)
    except ValidationError as exc:
        problems: dict[str, str] = {}  # first message per argument (a union type reports one per member)
        for error in exc.errors():
            name = str(error["loc"][0]) if error["loc"] else "arguments"
            problems.setdefault(name, f"{name}={kwargs.get(name)!r}: {error['msg']}")
        raise ValueError("LoopedSpecEngine: " + "; ".join(problems.values())) from None
