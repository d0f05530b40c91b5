"""Ouro (ByteDance Ouro-1.4B / 2.6B): sandwich-norm blocks, final norm after every loop, exit gate."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looped_spec.adapters.llama_style import LlamaStyleLooped, check_llama_style, llama_layer_specs
from looped_spec.models.adapter import register_adapter
from looped_spec.models.checkpoint import TensorSpec
from looped_spec.models.config_fields import float_field, int_field
from looped_spec.models.layers import rms_norm


@register_adapter
class OuroAdapter(LlamaStyleLooped):
    """Ouro: `h = h + norm2(attn(norm1(h)))`, `h = h + norm2'(mlp(norm1'(h)))`, then `model.norm` per loop."""

    model_type = "ouro"

    @classmethod
    def tensor_specs(cls, config: dict) -> dict[str, TensorSpec]:
        norms = ("input_layernorm", "input_layernorm_2", "post_attention_layernorm", "post_attention_layernorm_2")
        specs = llama_layer_specs(config, norms)
        hidden = int_field(config, "hidden_size")
        specs["model.early_exit_gate.weight"] = TensorSpec((1, hidden))
        specs["model.early_exit_gate.bias"] = TensorSpec((1,))
        return specs

    @classmethod
    def check_config(cls, config: dict) -> None:
        check_llama_style(config)
        int_field(config, "total_ut_steps", 4)
        threshold = float_field(config, "early_exit_threshold", 1.0, positive=False)
        if not 0.0 < threshold:
            raise ValueError(f"early_exit_threshold={threshold} must be > 0")

    @property
    def full_depth(self) -> int:
        return int_field(self.config, "total_ut_steps", 4)

    def loop(self, state: torch.Tensor, loop_index: int, ctx) -> torch.Tensor:
        h = state
        for i, w in enumerate(self.layer_weights):
            plane = loop_index * self.num_layers + i
            attn = self.attend(rms_norm(h, w["input_layernorm.weight"], self.eps), w, ctx, plane)
            h = h + rms_norm(attn, w["input_layernorm_2.weight"], self.eps)
            mlp = self.mlp(rms_norm(h, w["post_attention_layernorm.weight"], self.eps), w)
            h = h + rms_norm(mlp, w["post_attention_layernorm_2.weight"], self.eps)
        return rms_norm(h, self.weights["model.norm.weight"], self.eps)

    def readout(self, state: torch.Tensor, depth: int, ctx) -> torch.Tensor:
        return self.head(state)

    def readout_hidden(self, state: torch.Tensor, depth: int, ctx) -> torch.Tensor:
        return state  # the loop ends on the final norm: the readout is the head alone

    def exit_signal(self, state: torch.Tensor, depth: int, prev_state: torch.Tensor | None = None):
        """Gate logit g_s [num_tokens] (fp32); `exit_pdf` turns the D gate logits into exit probabilities."""
        gate = F.linear(state, self.weights["model.early_exit_gate.weight"], self.weights["model.early_exit_gate.bias"])
        return gate.float().squeeze(-1)

    # ----- early exit: the first step whose cumulative exit probability reaches tau -----
    has_exit_rule = True
    exit_rule_uses_depth = False  # the rule reads the state (and carry), not the loop count
    default_exit_threshold_source = "config early_exit_threshold"
    max_exit_threshold = 1.0  # tau is a cumulative exit probability (1.0: never before D)

    @property
    def default_exit_threshold(self) -> float | None:
        return float_field(self.config, "early_exit_threshold", 1.0, positive=False)

    def exit_rule_can_fire(self, threshold: float) -> bool:
        # tau >= 1 means step D: the cumulative probability before D is 1 - prod(1 - lambda) < 1 unless a gate
        # saturates to exactly 1.0 in fp32 (logit >= 16.75), an artefact looped-spec does not reproduce
        return threshold < 1.0

    def exit_carry(self, num_rows: int) -> torch.Tensor:
        # [num_rows, 2]: (probability of not having exited yet, cumulative exit probability)
        carry = torch.zeros(num_rows, 2, device=self.device)
        carry[:, 0] = 1.0
        return carry

    def exit_rule(self, state, depth, prev_state, carry, threshold, ctx):
        lam = torch.sigmoid(self.exit_signal(state, depth))  # [n] exit probability at this step
        survive, cdf = carry[:, 0], carry[:, 1]
        cdf = cdf + lam * survive  # the same sums, in the same order, as cumsum(exit_pdf)
        survive = survive * (1 - lam)
        return cdf >= threshold, torch.stack([survive, cdf], dim=-1), None

    @staticmethod
    def exit_pdf(gate_logits: torch.Tensor) -> torch.Tensor:
        """[..., D] gate logits -> [..., D] exit distribution (the last step takes the remaining mass)."""
        lam = torch.sigmoid(gate_logits.float())
        survive = torch.cumprod(1 - lam, dim=-1)
        before = torch.cat([torch.ones_like(survive[..., :1]), survive[..., :-1]], dim=-1)
        pdf = lam * before
        pdf[..., -1] = before[..., -1]
        return pdf

    @property
    def max_positions(self) -> int:
        return int_field(self.config, "max_position_embeddings", 32768, minimum=2)
