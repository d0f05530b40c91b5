"""Nanbeige4.2: plain Llama pre-norm blocks looped `num_loops` times, final norm between loops."""

from __future__ import annotations

import torch

from looped_spec.adapters.llama_style import LlamaStyleLooped, check_llama_style, llama_layer_specs
from looped_spec.models.adapter import register_adapter
from looped_spec.models.checkpoint import TensorSpec
from looped_spec.models.config_fields import bool_field, int_field
from looped_spec.models.layers import rms_norm

# Nanbeige architecture switches this adapter does not implement: set, they change the math, so loading
# such a checkpoint as plain looped Llama would generate different tokens silently.
UNSUPPORTED_FLAGS = (
    "loop_share_kv",
    "enable_double_loop_split",
    "enable_depth_attention",
    "qk_layernorm",
    "loop_middle_layers",
    "enable_hyper_connection",
    "enable_mhc",
    "emb_neighbor_num",
)


@register_adapter
class NanbeigeAdapter(LlamaStyleLooped):
    """`h = h + attn(norm(h))`, `h = h + mlp(norm(h))` per layer; `model.norm` after each loop unless
    `skip_loop_final_norm`, in which case the norm is applied once, after the last loop run — so a
    readout at depth k applies it to the loop-k state."""

    model_type = "nanbeige"

    @classmethod
    def tensor_specs(cls, config: dict) -> dict[str, TensorSpec]:
        return llama_layer_specs(config, ("input_layernorm", "post_attention_layernorm"))

    @classmethod
    def check_config(cls, config: dict) -> None:
        check_llama_style(config)
        for flag in UNSUPPORTED_FLAGS:
            value = config.get(flag)
            if value not in (None, False, 0, [], {}):
                raise ValueError(f"{flag}={value!r} is not supported by looped-spec's Nanbeige adapter")
        weights = config.get("loop_loss_weights")
        if weights is not None and not isinstance(weights, list):
            raise ValueError(f"loop_loss_weights={weights!r} must be a list")
        bool_field(config, "skip_loop_final_norm", False)
        cls.loops_of(config)

    @staticmethod
    def loops_of(config: dict) -> int:
        weights = config.get("loop_loss_weights") or []
        return len(weights) + 1 if weights else int_field(config, "num_loops", 2)

    @property
    def full_depth(self) -> int:
        return self.loops_of(self.config)

    @property
    def skip_loop_final_norm(self) -> bool:
        return bool_field(self.config, "skip_loop_final_norm", False)

    def loop(self, state: torch.Tensor, loop_index: int, ctx) -> torch.Tensor:
        h = state
        for i, w in enumerate(self.layer_weights):
            plane = loop_index * self.num_layers + i
            h = h + self.attend(rms_norm(h, w["input_layernorm.weight"], self.eps), w, ctx, plane)
            h = h + self.mlp(rms_norm(h, w["post_attention_layernorm.weight"], self.eps), w)
        if self.skip_loop_final_norm:
            return h
        return rms_norm(h, self.weights["model.norm.weight"], self.eps)

    def readout(self, state: torch.Tensor, depth: int, ctx) -> torch.Tensor:
        return self.head(self.readout_hidden(state, depth, ctx))

    def readout_hidden(self, state: torch.Tensor, depth: int, ctx) -> torch.Tensor:
        if self.skip_loop_final_norm:
            return rms_norm(state, self.weights["model.norm.weight"], self.eps)
        return state
