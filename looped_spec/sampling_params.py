"""User-facing request parameters, validated at the boundary (pydantic)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator


class SamplingParams(BaseModel):
    """How to generate for one request. Impossible values raise a ValidationError naming the field."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_tokens: int = Field(16, gt=0, description="Most tokens to generate.")
    temperature: float = Field(0.0, ge=0.0, description="0 = greedy; otherwise softmax temperature.")
    top_k: int = Field(0, ge=-1, le=2**31 - 1, description="Keep the k most likely tokens (0 or -1 = all).")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass in (0, 1].")
    seed: int | None = Field(
        None, ge=0, le=2**63 - 1, description="Per-request seed; None = drawn from the engine seed."
    )
    stop_token_ids: list[int] = Field(default_factory=list, description="Tokens that end the request (kept).")
    ignore_eos: bool = Field(False, description="Keep generating past the model's eos token.")

    @field_validator("stop_token_ids")
    @classmethod
    def _non_negative(cls, ids: list[int]) -> list[int]:
        for i, token in enumerate(ids):
            if token < 0:
                raise ValueError(f"stop_token_ids[{i}] = {token} is negative")
        return ids

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class SpeculativeConfig(BaseModel):
    """A fixed speculation plan: draft `k` tokens with the first `d` loops (k = 0: plain decoding)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    k: int = Field(2, ge=0, le=64, description="Draft tokens per round.")
    d: int = Field(1, ge=1, description="Loops used by the draft (must be < the model's full depth).")
    measure_depths: bool = Field(False, description="Also read out other depths (counterfactual acceptance).")
