"""Cache-free attention (`DenseContext`): the reference path behind `ModelAdapter.dense_logits`.

Model code computes (q, k, v) for a flat batch of tokens and calls `ctx.attention(plane, q, k, v)`; the context
decides where keys live and who may attend to whom. This one attends causally within equal-length sequences;
the engine's `execution.attention.PagedContext` reads and writes the paged KV cache instead.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal=False) -> torch.Tensor:
    """q: [B, H, Tq, hd], k/v: [B, KVH, Tk, hd] -> [B, H, Tq, hd] (grouped-query when KVH < H)."""
    return F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, enable_gqa=k.shape[1] != q.shape[1]
    )


@dataclass
class DenseContext:
    """Cache-free causal attention for `batch_size` sequences of `seq_len` tokens each."""

    batch_size: int
    seq_len: int
    positions: torch.Tensor  # [num_tokens] long
    seeds: list[int] | None = None  # one per sequence (Huginn's random initial state)
    memo: dict = field(default_factory=dict)

    def attention(self, plane: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        b, t = self.batch_size, self.seq_len
        out = sdpa(
            q.view(b, t, *q.shape[1:]).transpose(1, 2),
            k.view(b, t, *k.shape[1:]).transpose(1, 2),
            v.view(b, t, *v.shape[1:]).transpose(1, 2),
            causal=True,
        )
        return out.transpose(1, 2).reshape(q.shape)

    def token_seeds(self) -> list[tuple[int, int]]:
        """(request seed, position) per token, for per-token deterministic random draws."""
        seeds = self.seeds or [0] * self.batch_size
        pos = self.positions.tolist()
        return [(seeds[i // self.seq_len], pos[i]) for i in range(len(pos))]
