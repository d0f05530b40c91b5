"""Shared code of the Llama-named looped families (Ouro, Nanbeige): config fields, tensor names, and the
embedding, attention, MLP and head they run the same way."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from looped_spec.models.adapter import ModelAdapter
from looped_spec.models.checkpoint import TensorSpec
from looped_spec.models.config_fields import bool_field, float_field, int_field, rope_theta
from looped_spec.models.kv_layout import KVLayout
from looped_spec.models.layers import memo_half_rope, self_attention, swiglu


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
    tied = bool_field(config, "tie_word_embeddings", False)
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
    bool_field(config, "tie_word_embeddings", False)
    for flag in ("attention_bias", "mlp_bias"):
        if bool_field(config, flag, False):
            raise ValueError(f"{flag} = true is not supported")
    if bool_field(config, "use_sliding_window", False):
        window = config.get("sliding_window")
        raise ValueError(f"use_sliding_window with sliding_window={window!r} is not supported")
    for i, kind in enumerate(config.get("layer_types") or []):
        if kind != "full_attention":
            raise ValueError(f"layer_types[{i}] = {kind!r} is not supported (only full_attention)")


class LlamaStyleLooped(ModelAdapter):
    """Shared plumbing of the Llama-named looped families (Ouro, Nanbeige)."""

    uniform_loops = True  # every loop runs the same layers; the readout (norm + head) ignores depth
    embed_uses_context = False  # a table lookup

    def __init__(self, config, weights, **kwargs):
        super().__init__(config, weights, **kwargs)
        self.hidden, _, self.num_layers, self.num_heads, self.num_kv_heads, self.head_dim = llama_dims(config)
        self.eps = float_field(config, "rms_norm_eps", 1e-6)
        self.rope_theta = rope_theta(config, 10000.0)
        # tied, the head is the embedding even where the file stores one, as transformers ties them at load
        if bool_field(config, "tie_word_embeddings", False) or "lm_head.weight" not in self.weights:
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
        return KVLayout(planes, self.num_kv_heads, self.head_dim, planes)

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

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights["lm_head.weight"]).float()
