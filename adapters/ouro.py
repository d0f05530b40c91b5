"""Ouro (ByteDance Ouro-1.4B / 2.6B): sandwich-norm blocks, final norm after every loop, exit gate."""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from looped_spec.adapter import KVLayout, ModelAdapter, register_adapter
from looped_spec.checkpoint import TensorSpec
from looped_spec.config_fields import float_field, int_field, rope_theta
from looped_spec.layers import memo_half_rope, rms_norm, self_attention, swiglu

logger = logging.getLogger(__name__)


def llama_dims(config: dict) -> tuple[int, int, int, int, int, int]:
    """(hidden, intermediate, layers, heads, kv_heads, head_dim) from a Llama-style config."""
    hidden = int_field(config, "hidden_size")
    heads = int_field(config, "num_attention_heads")
    kv_heads = int_field(config, "num_key_value_heads", heads)
    head_dim = int_field(config, "head_dim", None) or hidden // heads
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads}")
    if head_dim % 2:
        raise ValueError(f"head_dim={head_dim} must be even (RoPE rotates pairs)")
    return (
        hidden,
        int_field(config, "intermediate_size"),
        int_field(config, "num_hidden_layers"),
        heads,
        kv_heads,
        head_dim,
    )


def llama_layer_specs(config: dict, norms: tuple[str, ...]) -> dict[str, TensorSpec]:
    hidden, inter, layers, heads, kv_heads, head_dim = llama_dims(config)
    specs: dict[str, TensorSpec] = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        specs[p + "self_attn.q_proj.weight"] = TensorSpec((heads * head_dim, hidden))
        specs[p + "self_attn.k_proj.weight"] = TensorSpec((kv_heads * head_dim, hidden))
        specs[p + "self_attn.v_proj.weight"] = TensorSpec((kv_heads * head_dim, hidden))
        specs[p + "self_attn.o_proj.weight"] = TensorSpec((hidden, heads * head_dim))
        specs[p + "mlp.gate_proj.weight"] = TensorSpec((inter, hidden))
        specs[p + "mlp.up_proj.weight"] = TensorSpec((inter, hidden))
        specs[p + "mlp.down_proj.weight"] = TensorSpec((hidden, inter))
        for norm in norms:
            specs[p + norm + ".weight"] = TensorSpec((hidden,))
    vocab = int_field(config, "vocab_size")
    specs["model.embed_tokens.weight"] = TensorSpec((vocab, hidden))
    specs["model.norm.weight"] = TensorSpec((hidden,))
    tied = bool(config.get("tie_word_embeddings", False))
    specs["lm_head.weight"] = TensorSpec((vocab, hidden), optional=tied)
    # RoPE frequency buffers some exports store (older transformers, per layer): recomputed, so ignored
    specs["model.rotary_emb.inv_freq"] = TensorSpec((head_dim // 2,), optional=True, ignored=True)
    for i in range(layers):
        specs[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = TensorSpec(
            (head_dim // 2,), optional=True, ignored=True
        )
    return specs


def check_llama_style(config: dict) -> None:
    """Config values shared by the Llama-named families that this implementation does not support."""
    llama_dims(config)
    int_field(config, "vocab_size")
    rope_theta(config, 10000.0)
    float_field(config, "rms_norm_eps", 1e-6)
    int_field(config, "max_position_embeddings", 4096, minimum=2)
    if config.get("rope_scaling"):
        raise ValueError(f"rope_scaling {config['rope_scaling']!r} is not supported (only plain RoPE)")
    if config.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {config['hidden_act']!r} is not supported (only 'silu')")
    for flag in ("attention_bias", "mlp_bias"):
        if config.get(flag):
            raise ValueError(f"{flag} = true is not supported")
    if config.get("use_sliding_window"):
        window = config.get("sliding_window")
        raise ValueError(f"use_sliding_window with sliding_window={window!r} is not supported")
    for i, kind in enumerate(config.get("layer_types") or []):
        if kind != "full_attention":
            raise ValueError(f"layer_types[{i}] = {kind!r} is not supported (only full_attention)")


class LlamaStyleLooped(ModelAdapter):
    """Shared plumbing of the Llama-named looped families (Ouro, Nanbeige)."""

    uniform_loops = True  # every loop runs the same layers; the readout (norm + head) ignores depth

    def __init__(self, config, weights, **kwargs):
        super().__init__(config, weights, **kwargs)
        if self.options:
            raise ValueError(f"unknown {self.model_type} adapter option(s) {sorted(self.options)}; it takes none")
        self.hidden, _, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = llama_dims(config)
        self.eps = float_field(config, "rms_norm_eps", 1e-6)
        self.rope_theta = rope_theta(config, 10000.0)
        if "lm_head.weight" not in self.weights:
            self.weights["lm_head.weight"] = self.weights["model.embed_tokens.weight"]
        self.layer_weights = [
            {k[len(f"model.layers.{i}.") :]: v for k, v in self.weights.items() if k.startswith(f"model.layers.{i}.")}
            for i in range(self.num_layers)
        ]

    @property
    def vocab_size(self) -> int:
        return int_field(self.config, "vocab_size")

    @property
    def state_dim(self) -> int:
        return self.hidden

    @property
    def kv_layout(self) -> KVLayout:
        planes = self.full_depth * self.num_layers
        return KVLayout(planes, self.num_kv_heads, self.head_dim, planes, 0)

    def embed(self, token_ids: torch.Tensor, ctx) -> torch.Tensor:
        return F.embedding(token_ids, self.weights["model.embed_tokens.weight"])

    def attend(self, x: torch.Tensor, w: dict, ctx, plane: int) -> torch.Tensor:
        tables = memo_half_rope(ctx, self.head_dim, self.rope_theta)
        return self_attention(
            x,
            w["self_attn.q_proj.weight"],
            w["self_attn.k_proj.weight"],
            w["self_attn.v_proj.weight"],
            w["self_attn.o_proj.weight"],
            self.num_heads,
            self.num_kv_heads,
            self.head_dim,
            tables,
            ctx,
            plane,
        )

    @staticmethod
    def mlp(x: torch.Tensor, w: dict) -> torch.Tensor:
        return swiglu(x, w["mlp.gate_proj.weight"], w["mlp.up_proj.weight"], w["mlp.down_proj.weight"])

    def head(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weights["lm_head.weight"]).float()


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

    def exit_signal(self, state: torch.Tensor, depth: int, prev_state: torch.Tensor | None = None):
        """Gate logit g_s [num_tokens] (fp32); `exit_pdf` turns the D gate logits into exit probabilities."""
        gate = F.linear(state, self.weights["model.early_exit_gate.weight"], self.weights["model.early_exit_gate.bias"])
        return gate.float().squeeze(-1)

    # ----- early exit: the first step whose cumulative exit probability reaches tau -----
    has_exit_rule = True
    default_exit_threshold_source = "config early_exit_threshold"

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
        return cdf >= threshold, torch.stack([survive, cdf], dim=-1)

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
