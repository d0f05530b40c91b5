"""Attention contexts: where a layer's keys/values live and who it may attend to.

Model code computes (q, k, v) for a flat batch of tokens and calls
`ctx.attention(plane, q, k, v)`. The context decides the rest:

* `DenseContext`: cache-free causal attention over equal-length sequences
  (the reference path behind `ModelAdapter.dense_logits`).
* `PagedContext`: ragged batch of requests, each adding some new tokens at its
  own positions; keys/values are written into the paged `KVCache` plane and
  attention reads each request's blocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None, causal=False) -> torch.Tensor:
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
        out = _sdpa(
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


@dataclass
class PagedContext:
    """A ragged batch over the paged KV cache.

    Request r adds `query_lens[r]` tokens at positions `context_lens[r] - query_lens[r] ..
    context_lens[r] - 1`; tokens are laid out request after request.
    """

    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] flat cache slot each token's k/v is written to
    gather_slots: torch.Tensor  # [num_reqs, max_context] flat slots of each request's keys (padded)
    mask: torch.Tensor | None  # [num_reqs, 1, max_query, max_context] bool, None when no padding needed
    pad_index: torch.Tensor | None  # [num_tokens] index into the padded [num_reqs * max_query] query grid
    num_reqs: int
    max_query: int
    key_cache: torch.Tensor  # [num_planes, num_slots, kv_heads, head_dim]
    value_cache: torch.Tensor
    seeds_per_token: list[tuple[int, int]] | None = None
    memo: dict = field(default_factory=dict)
    # tokens whose k/v this pass writes (None = all): early exit's skip mode keeps an exited token's
    # cached (copied) KV in deeper loop planes while the other tokens of the pass go on
    write_index: torch.Tensor | None = None

    def attention(self, plane: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        key_plane, value_plane = self.key_cache[plane], self.value_cache[plane]
        slots = self.slot_mapping
        if self.write_index is not None:
            slots, k, v = slots[self.write_index], k[self.write_index], v[self.write_index]
        key_plane.index_copy_(0, slots, k.to(key_plane.dtype))
        value_plane.index_copy_(0, slots, v.to(value_plane.dtype))
        keys = key_plane[self.gather_slots].transpose(1, 2)  # [num_reqs, kv_heads, max_context, head_dim]
        values = value_plane[self.gather_slots].transpose(1, 2)
        num_heads, head_dim = q.shape[1], q.shape[2]
        if self.pad_index is None:
            queries = q.view(self.num_reqs, self.max_query, num_heads, head_dim)
        else:
            queries = q.new_zeros(self.num_reqs * self.max_query, num_heads, head_dim)
            queries.index_copy_(0, self.pad_index, q)
            queries = queries.view(self.num_reqs, self.max_query, num_heads, head_dim)
        out = _sdpa(queries.transpose(1, 2), keys, values, mask=self.mask)
        out = out.transpose(1, 2).reshape(self.num_reqs * self.max_query, num_heads, head_dim)
        return out if self.pad_index is None else out.index_select(0, self.pad_index)

    def token_seeds(self) -> list[tuple[int, int]]:
        if self.seeds_per_token is None:
            raise RuntimeError("this batch carries no per-token seeds")
        return self.seeds_per_token


def build_paged_context(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_size: int,
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    seeds: list[int] | None = None,
    need_token_seeds: bool = False,
) -> PagedContext:
    """Build the index tensors for one ragged batch (once per forward; shared by every loop and layer).

    Host-side index arithmetic is done on Python lists and turned into tensors with one call each:
    this runs once per draft step, so its fixed cost matters as much as a layer's.
    """
    device = key_cache.device
    num_reqs = len(context_lens)
    max_context = max(context_lens)
    max_query = max(query_lens)
    max_blocks = (max_context + block_size - 1) // block_size
    table = torch.tensor([(blocks + [0] * max_blocks)[:max_blocks] for blocks in block_tables], dtype=torch.long)
    in_block = torch.arange(block_size)
    gather_slots = (table[:, :, None] * block_size + in_block).view(num_reqs, -1)[:, :max_context]
    positions: list[int] = []
    slots: list[int] = []
    pad: list[int] = []
    starts = [c - q for c, q in zip(context_lens, query_lens)]
    for r, (start, n, blocks) in enumerate(zip(starts, query_lens, block_tables)):
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
            pad.append(r * max_query + pos - start)
    pad_index = None
    if any(n != max_query for n in query_lens):
        pad_index = torch.tensor(pad, dtype=torch.long, device=device)
    mask = None
    if max_query > 1 or any(c != max_context for c in context_lens):
        # query i of request r (at position starts[r] + i) sees keys at positions <= its own; padded query
        # rows see key 0 only (no all-masked row, so no NaN)
        q_pos = [[s + i if i < n else 0 for i in range(max_query)] for s, n in zip(starts, query_lens)]
        mask = (torch.arange(max_context)[None, None, :] <= torch.tensor(q_pos)[:, :, None])[:, None].to(device)
    token_seeds = None
    if need_token_seeds:
        seeds = seeds or [0] * num_reqs
        token_seeds = [(seeds[r], p) for r, n in enumerate(query_lens) for p in range(starts[r], starts[r] + n)]
    return PagedContext(
        positions=torch.tensor(positions, dtype=torch.long, device=device),
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        gather_slots=gather_slots.to(device),
        mask=mask,
        pad_index=pad_index,
        num_reqs=num_reqs,
        max_query=max_query,
        key_cache=key_cache,
        value_cache=value_cache,
        seeds_per_token=token_seeds,
    )
