"""CUDA-graph step runner: captured loop ranges (+ readout) over padded, static-shape batches.

A graph is keyed by (padded batch, tokens per request, first loop, last loop): the draft step
(`q = 1`, loops 1..d, readout d), the verify step (`q = K + 1`, loops d+1..D, readout D) and the
plain decode step (`q = 1`, loops 1..D, readout D). Inputs are copied into static buffers sized
for the key; padding rows write their keys and values to a scratch block and attend to it only.
Embedding runs eagerly (Huginn's per-token random initial state is drawn on the host), on the same
static context. Everything on the captured path is host-sync free: index tensors are built on the
host before replay and copied in, attention reads block slots and masks from device buffers.

With `capture=False` (CPU, or for debugging) the same padded static-buffer path runs eagerly, so
the padding and bucketing logic is testable without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from looped_spec.attention import PagedContext


@dataclass(frozen=True)
class GraphKey:
    batch: int  # padded number of requests
    query_len: int  # tokens per request (1 for draft/decode, K+1 for verify)
    start: int  # first loop (0-based)
    end: int  # one past the last loop; the readout is at depth `end`


def batch_buckets(max_batch_size: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 8 up to max_batch_size."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


def pad_batch(num_reqs: int, buckets: list[int]) -> int | None:
    """Smallest bucket holding `num_reqs` requests; None when the batch is larger than every bucket."""
    for size in buckets:
        if size >= num_reqs:
            return size
    return None


def graph_keys(plans: list[tuple[int, int]], full_depth: int, buckets: list[int]) -> list[GraphKey]:
    """Keys for plain decode plus the draft and verify steps of every (K, d) with K > 0; largest first."""
    shapes = {(1, 0, full_depth)}
    for k, d in plans:
        if k > 0:
            shapes.add((1, 0, d))
            shapes.add((k + 1, d, full_depth))
    keys = [GraphKey(b, q, s, e) for b in buckets for q, s, e in shapes]
    return sorted(keys, key=lambda key: (-key.batch * key.query_len, -(key.end - key.start)))


class SharedBuffers:
    """Input buffers allocated once at the largest graph's size; every StaticBatch takes views of them."""

    def __init__(self, keys: list[GraphKey], max_context: int, state_dim: int, dtype, device) -> None:
        max_tokens = max(k.batch * k.query_len for k in keys)
        max_batch = max(k.batch for k in keys)
        self.token_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.state = torch.zeros(max_tokens, state_dim, dtype=dtype, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.gather_slots = torch.zeros(max_batch * max_context, dtype=torch.long, device=device)
        self.mask = torch.zeros(max_tokens * max_context, dtype=torch.bool, device=device)


class StaticBatch:
    """Static-shape views of the shared buffers and a PagedContext over them, for one GraphKey."""

    def __init__(self, key: GraphKey, max_context: int, buffers: SharedBuffers, kv, scratch_slot: int):
        n = key.batch * key.query_len
        self.key = key
        self.max_context = max_context
        self.scratch_slot = scratch_slot
        self.token_ids = buffers.token_ids[:n]
        self.state = buffers.state[:n]  # [batch * q, state_dim]
        self.positions = buffers.positions[:n]
        self.slot_mapping = buffers.slot_mapping[:n]
        self.gather_slots = buffers.gather_slots[: key.batch * max_context].view(key.batch, max_context)
        self.mask = buffers.mask[: n * max_context].view(key.batch, 1, key.query_len, max_context)
        # a safe state for warm-up and capture: every row writes to and attends to the scratch block
        self.slot_mapping.fill_(scratch_slot)
        self.gather_slots.fill_(scratch_slot)
        self.mask.zero_()
        self.mask[..., 0] = True
        self.ctx = PagedContext(
            self.positions,
            self.slot_mapping,
            self.gather_slots,
            self.mask,
            None,
            key.batch,
            key.query_len,
            kv.key_cache,
            kv.value_cache,
        )

    def fill(
        self, block_tables: list[list[int]], context_lens: list[int], block_size: int, seeds: list[int] | None
    ) -> None:
        """Copy one batch's indices into the static buffers (host-built, one copy per buffer)."""
        key, q = self.key, self.key.query_len
        num_reqs = len(context_lens)
        max_blocks = (self.max_context + block_size - 1) // block_size
        table = torch.full((key.batch, max_blocks), -1, dtype=torch.long)
        for r, blocks in enumerate(block_tables):
            n = min(len(blocks), max_blocks)
            table[r, :n] = torch.tensor(blocks[:n], dtype=torch.long)
        offsets = torch.arange(self.max_context)
        blocks = table[:, offsets // block_size]
        gather = torch.where(blocks >= 0, blocks * block_size + offsets % block_size, self.scratch_slot)
        ctx_lens = torch.zeros(key.batch, dtype=torch.long)
        ctx_lens[:num_reqs] = torch.tensor(context_lens)
        start = (ctx_lens - q).clamp_min(0)
        q_pos = start[:, None] + torch.arange(q)[None, :]  # [batch, q]
        real = (torch.arange(key.batch) < num_reqs)[:, None].expand(-1, q)
        slots = torch.where(real, gather.gather(1, q_pos.clamp_max(self.max_context - 1)), self.scratch_slot)
        mask = (offsets[None, None, :] <= q_pos[:, :, None]) & real[:, :, None]
        mask[:, :, 0] |= ~real  # padding rows attend to their scratch key only
        gather[num_reqs:] = self.scratch_slot
        self.positions.copy_(torch.where(real, q_pos, 0).reshape(-1), non_blocking=True)
        self.slot_mapping.copy_(slots.reshape(-1), non_blocking=True)
        self.gather_slots.copy_(gather, non_blocking=True)
        self.mask.copy_(mask[:, None], non_blocking=True)
        if seeds is not None:
            pos = q_pos.reshape(-1).tolist()
            seeds = list(seeds) + [0] * (key.batch - num_reqs)
            self.ctx.seeds_per_token = [(seeds[i // q], pos[i]) for i in range(len(pos))]
        self.ctx.memo.clear()


class CudaGraphRunner:
    """Captures and replays `loops[start, end) + readout(end)` for every GraphKey of the active plans."""

    def __init__(
        self, adapter, kv, max_context: int, buckets: list[int], plans: list[tuple[int, int]], capture: bool = True
    ) -> None:
        self.adapter = adapter
        self.kv = kv
        self.block_size = kv.block_size
        self.max_context = ((max_context + kv.block_size - 1) // kv.block_size) * kv.block_size
        self.buckets = buckets
        self.capture = capture
        self.scratch_slot = kv.reserve_scratch_block() * kv.block_size
        self.buffers: SharedBuffers | None = None
        self.pool = None
        self.batches: dict[GraphKey, StaticBatch] = {}
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, tuple[torch.Tensor, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        self.add_plans(plans)

    def add_plans(self, plans: list[tuple[int, int]]) -> None:
        """Prepare (and capture, on CUDA) every key the plans need that is not there yet."""
        keys = graph_keys(plans, self.adapter.full_depth, self.buckets)
        new = [k for k in keys if k not in self.batches]
        if not new:
            return
        device = self.adapter.device
        if self.buffers is None or max(k.batch * k.query_len for k in keys) > self.buffers.token_ids.shape[0]:
            if self.batches:
                raise RuntimeError("graph shapes larger than the captured ones must be added before capture")
            self.buffers = SharedBuffers(keys, self.max_context, self.adapter.state_dim, self.adapter.dtype, device)
        mem0 = torch.cuda.memory_allocated(device) if self.capture else 0
        t0 = time.perf_counter()
        for key in new:  # largest first, so later graphs fit in the shared pool
            static = StaticBatch(key, self.max_context, self.buffers, self.kv, self.scratch_slot)
            self.batches[key] = static
            if not self.capture:
                continue
            with torch.inference_mode():
                self._body(static)  # warm-up: lazy init and autotuning happen outside the capture
                torch.cuda.synchronize(device)
                # tensors memoised during warm-up (RoPE tables) were computed eagerly: recompute them in-graph
                static.ctx.memo.clear()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.outputs[key] = self._body(static)
            self.pool = graph.pool()  # one memory pool shared by every graph
            self.graphs[key] = graph
        if self.capture:
            torch.cuda.synchronize(device)
            self.capture_bytes += torch.cuda.memory_allocated(device) - mem0
        self.capture_seconds += time.perf_counter() - t0

    def _body(self, static: StaticBatch) -> tuple[torch.Tensor, torch.Tensor]:
        state = static.state
        for i in range(static.key.start, static.key.end):
            state = self.adapter.loop(state, i, static.ctx)
        return state, self.adapter.readout(state, static.key.end, static.ctx)

    def step(self, requests, query_len, context_lens, start, end, tokens, state, probe, readout):
        """StepRunner entry: replay when a graph is captured for this shape; decline probes and other shapes."""
        if probe is not None:
            return None
        key = self.supports(len(requests), query_len, start, end)
        return None if key is None else self.run(key, requests, context_lens, tokens, state)

    def supports(self, num_reqs: int, query_len: int, start: int, end: int) -> GraphKey | None:
        padded = pad_batch(num_reqs, self.buckets)
        if padded is None:
            return None
        key = GraphKey(padded, query_len, start, end)
        return key if key in self.batches else None

    @torch.inference_mode()
    def run(
        self,
        key: GraphKey,
        requests,
        context_lens: list[int],
        tokens: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Embed `tokens` (or take `state`) for len(requests) real rows, replay; returns real-row (state, logits)."""
        static = self.batches[key]
        seeds = [r.seed for r in requests] if self.adapter.needs_token_seeds else None
        static.fill([r.block_table for r in requests], context_lens, self.block_size, seeds)
        n = len(requests) * key.query_len
        if tokens is not None:
            static.token_ids.zero_()
            static.token_ids[:n].copy_(tokens)
            static.state.copy_(self.adapter.embed(static.token_ids, static.ctx))
        else:
            static.state[:n].copy_(state)
        if self.capture:
            self.graphs[key].replay()
            out_state, logits = self.outputs[key]
            # outputs live in the shared graph pool: the next replay may overwrite them
            return out_state[:n].clone(), logits[:n].clone()
        out_state, logits = self._body(static)
        return out_state[:n], logits[:n]
