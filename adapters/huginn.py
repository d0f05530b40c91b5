"""Huginn-0125 (`huginn_raven`): prelude -> recurrent core with linear injection -> coda.

State layout: `[num_tokens, 2 * n_embd]` = concat(latent x, prelude output e), so a loop is
`x = adapter(state)` followed by the core blocks, with e carried along unchanged.
"""

from __future__ import annotations

import math
import numbers
from typing import Any

import torch
import torch.nn.functional as F

from looped_spec.execution.transfers import to_device
from looped_spec.models.adapter import ModelAdapter, register_adapter
from looped_spec.models.checkpoint import TensorSpec
from looped_spec.models.config_fields import bool_field, float_field, int_field, rope_theta
from looped_spec.models.kv_layout import KVLayout
from looped_spec.models.layers import apply_rope_interleaved, fused_swiglu, memo_interleaved_rope, rms_norm

_MIX = 0x9E3779B97F4A7C15  # odd 64-bit constant: spreads (seed, position) over generator seeds


# The original code's architecture switches, with the one choice this adapter implements (absent = that one).
IMPLEMENTED_CHOICES = {
    "injection_type": "linear",
    "state_init": "like-init",  # the truncated-normal initial latent of the `initial_state="random"` option
    "block_class_name": "SandwichBlock",
    "mlp_class_name": "GatedMLP",
    "nonlin_name": "SiLU",
    "norm_class_name": "RMSNorm_llama",
}


def reference_freqs_cis(config: dict) -> torch.Tensor:
    """The RoPE buffer the original Huginn code stores as `freqs_cis`: [1, block_size, 1, head_dim / 2, 2]
    (cos, sin) in fp32. looped-spec recomputes RoPE and ignores it; shipped checkpoints carry it so the
    original code, which loads it rather than recomputing, gets real values instead of uninitialised memory."""
    head_dim = int_field(config, "n_embd") // int_field(config, "n_heads")
    base = rope_theta(config, 50000.0, key="rope_base")
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float32)[: head_dim // 2] / head_dim))
    angles = torch.outer(torch.arange(int_field(config, "block_size", 4096), dtype=torch.float32), inv_freq)
    return torch.stack([angles.cos(), angles.sin()], dim=-1)[None, :, None]


@register_adapter
class HuginnAdapter(ModelAdapter):
    """Options: `initial_state` = "random" (default; reference distribution, keyed by request seed and
    token position) or "zeros"; `num_steps` overrides `mean_recurrence` as the full depth D;
    `exit_criterion` = "kl" (default; the Huginn authors' zero-shot adaptive compute: KL divergence
    KL(p_{s-1} || p_s) of successive steps' next-token distributions below `exit_threshold`, 5e-4 in their
    paper) or "latent" (relative latent change ||x_s - x_{s-1}|| / ||x_s|| below the threshold);
    `exit_threshold` (> 0, in the criterion's units; e.g. `PAPER_KL_THRESHOLD`) = the threshold of requests
    that set neither `exit_threshold` nor `exit_at_step` (unset: they run all `num_steps`, no early exit)."""

    model_type = "huginn_raven"
    readout_uses_kv = True
    uniform_loops = True  # core block: same weights every loop; the coda readout ignores depth
    option_names = ("initial_state", "num_steps", "exit_criterion", "exit_threshold")

    @classmethod
    def checked_options(cls, options: dict[str, Any], config: dict) -> dict[str, Any]:
        options = super().checked_options(options, config)
        init = options.get("initial_state", "random")
        if init not in ("random", "zeros"):
            raise ValueError(f"adapter option initial_state={init!r}: use 'random' or 'zeros'")
        if "num_steps" in options:
            steps = options["num_steps"]
            # any integer type (a numpy sweep's too), kept as int so that a preset's provenance can record it
            if not isinstance(steps, numbers.Integral) or isinstance(steps, bool) or steps < 1:
                raise ValueError(f"adapter option num_steps={steps!r} must be a positive integer")
            options["num_steps"] = int(steps)
        criterion = options.get("exit_criterion", "kl")
        if criterion not in ("kl", "latent"):
            raise ValueError(f"adapter option exit_criterion={criterion!r}: use 'kl' or 'latent'")
        if "exit_threshold" in options:
            try:
                options["exit_threshold"] = float_field(options, "exit_threshold", None)
            except ValueError as exc:
                raise ValueError(f"adapter option {exc} (the default early-exit threshold of requests)") from None
        return options

    def __init__(self, config, weights, **kwargs):
        super().__init__(config, weights, **kwargs)
        self.hidden = int_field(config, "n_embd")
        self.num_heads = int_field(config, "n_heads")
        self.num_kv_heads = int_field(config, "num_key_value_heads", self.num_heads)
        self.head_dim = self.hidden // self.num_heads
        self.eps = float_field(config, "norm_eps", 1e-6)
        self.rope_base = rope_theta(config, 50000.0, key="rope_base")
        self.num_prelude = int_field(config, "n_layers_in_prelude", minimum=0)
        self.num_core = int_field(config, "n_layers_in_recurrent_block")
        self.num_coda = int_field(config, "n_layers_in_coda", minimum=0)
        self.initial_state_mode = self.options.get("initial_state", "random")
        self._full_depth = self.options.get("num_steps", int_field(config, "mean_recurrence", 32))
        self.exit_criterion = self.options.get("exit_criterion", "kl")
        self._default_exit_threshold = self.options.get("exit_threshold")
        # tied, the head is the embedding even where the file stores one, as transformers ties them at load
        if bool_field(config, "tie_embeddings", True) or "lm_head.weight" not in self.weights:
            self.weights["lm_head.weight"] = self.weights["transformer.wte.weight"]
        group = (
            lambda prefix, n: [  # noqa: E731
                {k[len(f"{prefix}.{i}.") :]: v for k, v in self.weights.items() if k.startswith(f"{prefix}.{i}.")}
                for i in range(n)
            ]
        )
        self.prelude = group("transformer.prelude", self.num_prelude)
        self.core = group("transformer.core_block", self.num_core)
        self.coda = group("transformer.coda", self.num_coda)

    @classmethod
    def tensor_specs(cls, config: dict) -> dict[str, TensorSpec]:
        d = int_field(config, "n_embd")
        heads = int_field(config, "n_heads")
        kv = int_field(config, "num_key_value_heads", heads)
        hd = d // heads
        inter = int_field(config, "intermediate_size")
        vocab = int_field(config, "padded_vocab_size", None) or int_field(config, "vocab_size")
        specs: dict[str, TensorSpec] = {
            "transformer.wte.weight": TensorSpec((vocab, d)),
            "transformer.adapter.weight": TensorSpec((d, 2 * d)),
            "transformer.ln_f.weight": TensorSpec((d,)),
            "lm_head.weight": TensorSpec((vocab, d), optional=bool_field(config, "tie_embeddings", True)),
            "freqs_cis": TensorSpec((), optional=True, ignored=True),
        }
        for prefix, key in (
            ("prelude", "n_layers_in_prelude"),
            ("core_block", "n_layers_in_recurrent_block"),
            ("coda", "n_layers_in_coda"),
        ):
            for i in range(int_field(config, key, minimum=0)):
                p = f"transformer.{prefix}.{i}."
                for n in range(1, 5):
                    specs[p + f"norm_{n}.weight"] = TensorSpec((d,))
                specs[p + "attn.Wqkv.weight"] = TensorSpec(((heads + 2 * kv) * hd, d))
                specs[p + "attn.proj.weight"] = TensorSpec((d, heads * hd))
                if bool_field(config, "qk_bias", False):
                    specs[p + "attn.qk_bias"] = TensorSpec((2, 1, heads, hd))
                specs[p + "mlp.fc.weight"] = TensorSpec((2 * inter, d))
                specs[p + "mlp.proj.weight"] = TensorSpec((d, inter))
        return specs

    @classmethod
    def check_config(cls, config: dict) -> None:
        for key in ("n_embd", "n_heads", "n_layers_in_recurrent_block", "intermediate_size", "vocab_size"):
            int_field(config, key)
        for key in ("n_layers_in_prelude", "n_layers_in_coda"):
            int_field(config, key, minimum=0)
        int_field(config, "mean_recurrence", 32)
        int_field(config, "block_size", 4096, minimum=2)
        float_field(config, "norm_eps", 1e-6)
        rope_theta(config, 50000.0, key="rope_base")
        if config.get("rope_scaling"):
            raise ValueError(f"rope_scaling {config['rope_scaling']!r} is not supported (only plain RoPE)")
        for key, implemented in IMPLEMENTED_CHOICES.items():
            if config.get(key, implemented) != implemented:
                raise ValueError(f"{key} {config[key]!r} is not supported (only {implemented!r})")
        heads = int_field(config, "n_heads")
        if int_field(config, "n_embd") % heads:
            raise ValueError("n_embd must be a multiple of n_heads")
        if (int_field(config, "n_embd") // heads) % 2:
            raise ValueError("n_embd / n_heads (the head size) must be even (RoPE rotates pairs)")
        kv = int_field(config, "num_key_value_heads", heads)
        if heads % kv:
            raise ValueError(f"n_heads {heads} is not a multiple of num_key_value_heads {kv}")
        bool_field(config, "tie_embeddings", True)
        if bool_field(config, "qk_bias", False) and kv != heads:
            raise ValueError("qk_bias with num_key_value_heads != n_heads is not supported")
        if bool_field(config, "bias", False):
            raise ValueError("bias = true is not supported")

    # ----- description -----
    @property
    def full_depth(self) -> int:
        return self._full_depth

    @property
    def max_dense_depth(self) -> int:
        return 1 << 16

    @property
    def vocab_size(self) -> int:
        return int(self.weights["transformer.wte.weight"].shape[0])

    @property
    def state_dim(self) -> int:
        return 2 * self.hidden

    @property
    def kv_layout(self) -> KVLayout:
        loop_planes = self.full_depth * self.num_core
        token_planes = self.num_prelude + self.num_coda
        return KVLayout(
            loop_planes + token_planes, self.num_kv_heads, self.head_dim, loop_planes, first_loop_plane=self.num_prelude
        )

    @property
    def max_positions(self) -> int:
        return int_field(self.config, "block_size", 4096, minimum=2)

    @property
    def needs_token_seeds(self) -> bool:
        return self.initial_state_mode == "random"

    # ----- math -----
    def block(self, x: torch.Tensor, w: dict, ctx, plane: int) -> torch.Tensor:
        n = x.shape[0]
        h = rms_norm(x, w["norm_1.weight"], self.eps)
        qkv = F.linear(h, w["attn.Wqkv.weight"])
        q, k, v = qkv.split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim],
            dim=-1,
        )
        q = q.view(n, self.num_heads, self.head_dim)
        k = k.view(n, self.num_kv_heads, self.head_dim)
        v = v.view(n, self.num_kv_heads, self.head_dim)
        if "attn.qk_bias" in w:
            q = q + w["attn.qk_bias"][0]
            k = k + w["attn.qk_bias"][1]
        tables = memo_interleaved_rope(ctx, self.head_dim, self.rope_base)
        q = apply_rope_interleaved(q, tables)
        k = apply_rope_interleaved(k, tables)
        attn = F.linear(ctx.attention(plane, q, k, v).reshape(n, -1), w["attn.proj.weight"])
        x = rms_norm(attn + x, w["norm_2.weight"], self.eps)
        mlp = fused_swiglu(rms_norm(x, w["norm_3.weight"], self.eps), w["mlp.fc.weight"], w["mlp.proj.weight"])
        return rms_norm(mlp + x, w["norm_4.weight"], self.eps)

    def initial_latent(self, num_tokens: int, ctx) -> torch.Tensor:
        """x0 per token: zeros, or the reference's truncated normal drawn from a (seed, position) generator."""
        if self.initial_state_mode == "zeros":
            return torch.zeros(num_tokens, self.hidden, device=self.device, dtype=self.dtype)
        std = math.sqrt(2.0 / (5.0 * self.hidden))
        x0 = torch.empty(num_tokens, self.hidden, dtype=torch.float64)
        gen = torch.Generator()
        for row, (seed, pos) in zip(x0, ctx.token_seeds(), strict=True):
            gen.manual_seed((seed * _MIX + pos * 0x2545F491 + 1) % (1 << 63))
            torch.nn.init.trunc_normal_(row, std=std, a=-3 * std, b=3 * std, generator=gen)
        x0 *= math.sqrt(self.hidden)  # the embedding scale, as in the reference
        return to_device(x0, self.device, self.dtype)

    def embed(self, token_ids: torch.Tensor, ctx) -> torch.Tensor:
        e = F.embedding(token_ids, self.weights["transformer.wte.weight"]) * math.sqrt(self.hidden)
        for i, w in enumerate(self.prelude):
            e = self.block(e, w, ctx, plane=i)
        return torch.cat([self.initial_latent(e.shape[0], ctx), e], dim=-1)

    def with_initial_state(self, state: torch.Tensor, initial: torch.Tensor) -> torch.Tensor:
        return torch.cat([initial.to(state), state[:, self.hidden :]], dim=-1)

    def loop(self, state: torch.Tensor, loop_index: int, ctx) -> torch.Tensor:
        e = state[:, self.hidden :]
        x = F.linear(state, self.weights["transformer.adapter.weight"])
        # loops past the cached depth (dense path only) reuse the last plane index; dense ignores planes
        base = self.num_prelude + min(loop_index, self.full_depth - 1) * self.num_core
        for j, w in enumerate(self.core):
            x = self.block(x, w, ctx, plane=base + j)
        return torch.cat([x, e], dim=-1)

    def readout(self, state: torch.Tensor, depth: int, ctx) -> torch.Tensor:
        return self.head(self.readout_hidden(state, depth, ctx))

    def readout_hidden(self, state: torch.Tensor, depth: int, ctx) -> torch.Tensor:
        """The coda (it attends: every position at once) and the final norm; `head` projects rows of it."""
        ln_f = self.weights["transformer.ln_f.weight"]
        x = rms_norm(state[:, : self.hidden], ln_f, self.eps)
        base = self.num_prelude + self.full_depth * self.num_core
        for j, w in enumerate(self.coda):
            x = self.block(x, w, ctx, plane=base + j)
        return rms_norm(x, ln_f, self.eps)

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weights["lm_head.weight"]).float()

    def exit_signal(self, state: torch.Tensor, depth: int, prev_state: torch.Tensor | None = None):
        """Relative latent change ||x_d - x_{d-1}|| / ||x_d|| per token (small = converged)."""
        if prev_state is None:
            return None
        x, prev = state[:, : self.hidden].float(), prev_state[:, : self.hidden].float()
        return (x - prev).norm(dim=-1) / x.norm(dim=-1).clamp_min(1e-12)

    # ----- early exit: convergence between successive steps -----
    has_exit_rule = True
    exit_rule_uses_depth = False  # the rule reads the state (and carry), not the loop count
    default_exit_threshold_source = "adapter option exit_threshold"
    #: the Huginn paper's KL threshold: a request opts in with SamplingParams(exit_threshold=...), or every
    #: request by default with the adapter option exit_threshold
    PAPER_KL_THRESHOLD = 5e-4

    @property
    def default_exit_threshold(self) -> float | None:
        return self._default_exit_threshold

    @property
    def exit_rule_reads_kv(self) -> bool:
        return self.exit_criterion == "kl"  # the KL rule reads out through the coda, which attends

    def exit_carry(self, num_rows: int) -> torch.Tensor | None:
        if self.exit_criterion == "latent":
            return None
        # "kl": the previous step's log-probabilities [num_rows, V]; before step 1 there are none, and NaN makes the
        # KL NaN, never below a threshold, so tokens at step 1 and later ones share one rule call (a loop pass)
        return torch.full((num_rows, self.vocab_size), math.nan, device=self.device)

    def exit_rule(self, state, depth, prev_state, carry, threshold, ctx):
        if self.exit_criterion == "latent":
            return self.exit_signal(state, depth, prev_state) < threshold, carry, None
        logits = self.readout(state, depth, ctx)
        log_probs = torch.log_softmax(logits, dim=-1)  # [n, V] fp32
        # KL(p_{s-1} || p_s): the reference's F.kl_div(log_probs, prev_log_probs, log_target=True) takes the previous
        # step's distribution as its target (KL is not symmetric; the other direction exits other tokens)
        kl = (carry.exp() * (carry - log_probs)).sum(-1)
        return kl < threshold, log_probs, logits  # NaN (step 1, `exit_carry`) < threshold is False
