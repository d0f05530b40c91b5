"""The paged attention context: where a layer's keys/values live and who it may attend to.

Model code computes (q, k, v) for a flat batch of tokens and calls
`ctx.attention(plane, q, k, v)`. The context decides the rest:

* `PagedContext`: ragged batch of requests, each adding some new tokens at its
  own positions; keys/values are written into the paged `KVCache` plane and
  attention reads each request's blocks: SDPA over copied blocks (the reference,
  any device) or, where `paged_kernel.kernel_available`, a paged kernel that
  reads each token's own keys in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from looped_spec.execution.paged_kernel import KernelBatch, num_splits_for
from looped_spec.execution.transfers import to_device
from looped_spec.models.dense import sdpa


@dataclass
class QueryGroup:
    """Requests of a ragged batch whose queries the reference path pads together (see `query_groups`)."""

    requests: torch.Tensor  # [n] long: the group's requests (rows of the gathered keys)
    tokens: torch.Tensor  # [t] long: their tokens in the flat batch
    max_query: int
    num_keys: int  # keys the group's requests attend over (its longest context)
    mask: torch.Tensor | None  # [n, 1, max_query, num_keys] bool
    pad_index: torch.Tensor | None  # [t] index into the group's padded [n * max_query] query grid


@dataclass
class PagedContext:
    """A ragged batch over the paged KV cache.

    Request r adds `query_lens[r]` tokens at positions `context_lens[r] - query_lens[r] ..
    context_lens[r] - 1`; tokens are laid out request after request.

    Keys are addressed by block: `block_table[r]` lists the blocks holding request r's first
    `num_keys` key positions (padding entries name any valid block; the mask hides them). The
    reference path copies those blocks (whole blocks, one `index_select` per plane) and runs SDPA
    over `num_keys` keys; with `kernel` set, a paged kernel reads each request's keys in place, each
    query token up to its own position (`paged_kernel.py`). `plane_shift` (a device scalar) moves
    every plane index by that many planes: a CUDA graph captured for loop 0 then serves every loop
    whose body is the same computation.
    """

    positions: torch.Tensor  # [num_tokens] long
    slot_mapping: torch.Tensor  # [num_tokens] slot (within a plane) each token's k/v is written to
    block_table: torch.Tensor  # [num_reqs, ceil(num_keys / block_size)] long
    num_keys: int  # keys per request the reference path attends over (its context, padded to the batch)
    mask: torch.Tensor | None  # [num_reqs, 1, max_query, num_keys] bool, None when no padding needed
    pad_index: torch.Tensor | None  # [num_tokens] index into the padded [num_reqs * max_query] query grid
    num_reqs: int
    max_query: int
    key_cache: torch.Tensor  # [num_planes, num_slots, kv_heads, head_dim]
    value_cache: torch.Tensor
    block_size: int
    kernel: KernelBatch | None = None
    plane_shift: torch.Tensor | None = None  # [1] long: planes added to every plane index (shared loop graphs)
    contiguous_from: int | None = None  # one request whose blocks are consecutive from this slot: read in place
    seeds_per_token: list[tuple[int, int]] | None = None
    memo: dict = field(default_factory=dict)
    # tokens whose k/v this pass writes (None = all): early exit's skip mode keeps an exited token's
    # cached (copied) KV in deeper loop planes while the other tokens of the pass go on
    write_index: torch.Tensor | None = None
    # loop-level batching: planes added to the plane index per request ([num_reqs] long) and per token
    # ([num_tokens]), so that one call of loop 0 serves each request at its own loop (loop_pass.py)
    request_planes: torch.Tensor | None = None
    token_planes: torch.Tensor | None = None
    # the reference path's query groups when one padded grid would mostly be padding (decoding rows beside a prompt
    # chunk): each group is padded to its own longest query and context; None: one grid
    groups: list[QueryGroup] | None = None
    # each request's query length, as built (a captured loop-pass readout pads its shape from them); None: not kept
    query_lens: list[int] | None = None

    def attention(self, plane: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        num_planes, num_slots, kv_heads, head_dim = self.key_cache.shape
        plane_index = plane if self.plane_shift is None else self.plane_shift + plane  # int or [1] tensor
        keys_flat = self.key_cache.view(num_planes * num_slots, kv_heads, head_dim)
        values_flat = self.value_cache.view(num_planes * num_slots, kv_heads, head_dim)
        slots, k_new, v_new = self.slot_mapping, k, v
        if self.write_index is not None:  # the other tokens keep their cached KV in this plane
            slots, k_new, v_new = slots[self.write_index], k[self.write_index], v[self.write_index]
        if self.token_planes is not None:
            planes = self.token_planes if self.write_index is None else self.token_planes[self.write_index]
            write_slots = slots + (planes + plane_index) * num_slots
        else:
            write_slots = slots + plane_index * num_slots
        keys_flat.index_copy_(0, write_slots, k_new.to(keys_flat.dtype))
        values_flat.index_copy_(0, write_slots, v_new.to(values_flat.dtype))
        if self.kernel is not None:
            return self.kernel.attend(q, self.key_cache, self.value_cache, plane, self.plane_shift, self.request_planes)
        keys, values = self.gather(plane_index)
        if self.groups is None:
            return _attend(q, keys, values, self.max_query, self.mask, self.pad_index)
        out = torch.empty_like(q)
        for g in self.groups:
            group_keys, group_values = keys[g.requests, :, : g.num_keys], values[g.requests, :, : g.num_keys]
            out[g.tokens] = _attend(q[g.tokens], group_keys, group_values, g.max_query, g.mask, g.pad_index)
        return out

    def gather(self, plane_index) -> tuple[torch.Tensor, torch.Tensor]:
        """Each request's first `num_keys` keys and values of one plane: [num_reqs, kv_heads, num_keys, head_dim].

        Copies whole blocks (contiguous runs of `block_size` slots) rather than single slots: the copy
        runs at memory speed and its size follows the batch's context, not `max_model_len`. A lone request
        whose blocks are consecutive (the allocator hands them out in order) is read in place.
        """
        num_planes, num_slots, kv_heads, head_dim = self.key_cache.shape
        if self.contiguous_from is not None and isinstance(plane_index, int):  # a view: nothing is copied
            keys = slice(self.contiguous_from, self.contiguous_from + self.num_keys)
            return (
                self.key_cache[plane_index, keys].unsqueeze(0).transpose(1, 2),
                self.value_cache[plane_index, keys].unsqueeze(0).transpose(1, 2),
            )
        blocks_per_plane = num_slots // self.block_size
        if self.request_planes is not None:
            plane_index = (self.request_planes + plane_index)[:, None]
        ids = (self.block_table + plane_index * blocks_per_plane).view(-1)
        shape = (num_planes * blocks_per_plane, self.block_size, kv_heads, head_dim)
        out = []
        for cache in (self.key_cache, self.value_cache):
            blocks = cache.view(shape).index_select(0, ids)  # [num_reqs * blocks, block_size, kv_heads, head_dim]
            out.append(blocks.view(self.num_reqs, -1, kv_heads, head_dim)[:, : self.num_keys].transpose(1, 2))
        return out[0], out[1]

    def token_seeds(self) -> list[tuple[int, int]]:
        if self.seeds_per_token is None:
            raise RuntimeError("this batch carries no per-token seeds")
        return self.seeds_per_token


def _attend(q, keys, values, max_query: int, mask, pad_index) -> torch.Tensor:
    """SDPA of one padded grid: q [t, H, hd] of n requests (their tokens flat), keys/values [n, KVH, Tk, hd]."""
    num_reqs, num_heads, head_dim = keys.shape[0], q.shape[1], q.shape[2]
    if pad_index is None:
        queries = q.reshape(num_reqs, max_query, num_heads, head_dim)
    else:
        queries = q.new_zeros(num_reqs * max_query, num_heads, head_dim)
        queries.index_copy_(0, pad_index, q)
        queries = queries.view(num_reqs, max_query, num_heads, head_dim)
    out = sdpa(queries.transpose(1, 2), keys, values, mask=mask)
    out = out.transpose(1, 2).reshape(num_reqs * max_query, num_heads, head_dim)
    return out if pad_index is None else out.index_select(0, pad_index)


def _grid(starts: list[int], query_lens: list[int], context_lens: list[int], device):
    """(max query, key count, mask or None, pad index or None) of one padded grid over these requests."""
    max_query, num_keys = max(query_lens), max(context_lens)
    pad = [r * max_query + i for r, n in enumerate(query_lens) for i in range(n)]
    pad_index = None if all(n == max_query for n in query_lens) else to_device(pad, device, torch.long)
    mask = None
    if max_query > 1 or any(c != num_keys for c in context_lens):
        # query i of request r (at position starts[r] + i) sees keys at positions <= its own; padded query
        # rows see key 0 only (no all-masked row, so no NaN)
        q_pos = [[s + i if i < n else 0 for i in range(max_query)] for s, n in zip(starts, query_lens)]
        mask = to_device((torch.arange(num_keys)[None, None, :] <= torch.tensor(q_pos)[:, :, None])[:, None], device)
    return max_query, num_keys, mask, pad_index


def query_groups(starts: list[int], query_lens: list[int], context_lens: list[int], device) -> list[QueryGroup] | None:
    """One-query requests apart from the others when one grid would be more than half padding: a loop pass that
    mixes decoding rows with a prompt chunk would otherwise pad every decoding row to the chunk's length."""
    if max(query_lens) == 1 or min(query_lens) > 1 or 2 * sum(query_lens) >= len(query_lens) * max(query_lens):
        return None
    first_token = [0]
    for n in query_lens:
        first_token.append(first_token[-1] + n)
    groups = []
    for chosen in ([r for r, n in enumerate(query_lens) if n == 1], [r for r, n in enumerate(query_lens) if n > 1]):
        tokens = [t for r in chosen for t in range(first_token[r], first_token[r + 1])]
        max_query, num_keys, mask, pad_index = _grid(
            [starts[r] for r in chosen], [query_lens[r] for r in chosen], [context_lens[r] for r in chosen], device
        )
        groups.append(QueryGroup(to_device(chosen, device, torch.long), to_device(tokens, device, torch.long),
                                 max_query, num_keys, mask, pad_index))  # fmt: skip
    return groups


def build_paged_context(
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_size: int,
    block_tables: list[list[int]],
    context_lens: list[int],
    query_lens: list[int],
    seeds: list[int] | None = None,
    need_token_seeds: bool = False,
    use_kernel: bool = False,
) -> PagedContext:
    """Build the index tensors for one ragged batch (once per forward; shared by every loop and layer).

    Host-side index arithmetic is done on Python lists and turned into tensors with one call each:
    this runs once per draft step, so its fixed cost matters as much as a layer's. With `use_kernel`
    the batch also carries the paged kernel's per-token inputs (its key count and request).
    """
    device = key_cache.device
    num_reqs = len(context_lens)
    max_context = max(context_lens)
    max_query = max(query_lens)
    max_blocks = (max_context + block_size - 1) // block_size
    block_table = to_device([(blocks + [0] * max_blocks)[:max_blocks] for blocks in block_tables], device, torch.long)
    positions: list[int] = []
    slots: list[int] = []
    starts = [c - q for c, q in zip(context_lens, query_lens)]
    for start, n, blocks in zip(starts, query_lens, block_tables):
        for pos in range(start, start + n):
            positions.append(pos)
            slots.append(blocks[pos // block_size] * block_size + pos % block_size)
    groups = None if use_kernel else query_groups(starts, query_lens, context_lens, device)
    pad_index = mask = None
    if groups is None:
        _, _, mask, pad_index = _grid(starts, query_lens, context_lens, device)
    token_seeds = None
    if need_token_seeds:
        seeds = seeds or [0] * num_reqs
        token_seeds = [(seeds[r], p) for r, n in enumerate(query_lens) for p in range(starts[r], starts[r] + n)]
    positions_t = to_device(positions, device, torch.long)
    kernel = None
    if use_kernel:
        kernel = KernelBatch(
            block_table=block_table,
            query_start=to_device(torch.tensor([0] + query_lens[:-1]).cumsum(0), device, torch.int32),
            query_len=to_device(query_lens, device, torch.int32),
            key_limit=(positions_t + 1).to(torch.int32),
            block_size=block_size,
            max_query=max_query,
            num_splits=num_splits_for(max_blocks),
        )
    used = block_tables[0][:max_blocks]
    contiguous = num_reqs == 1 and used == list(range(used[0], used[0] + max_blocks))
    return PagedContext(
        positions=positions_t,
        slot_mapping=to_device(slots, device, torch.long),
        block_table=block_table,
        num_keys=max_context,
        mask=mask,
        pad_index=pad_index,
        num_reqs=num_reqs,
        max_query=max_query,
        key_cache=key_cache,
        value_cache=value_cache,
        block_size=block_size,
        kernel=kernel,
        contiguous_from=used[0] * block_size if contiguous else None,
        seeds_per_token=token_seeds,
        groups=groups,
        query_lens=list(query_lens),
    )
