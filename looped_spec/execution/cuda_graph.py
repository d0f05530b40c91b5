"""CUDA-graph step runner: one captured loop iteration, replayed per loop, plus a captured readout.

A looped model runs the same computation in every loop; only the KV planes differ. For families
that say so (`ModelAdapter.uniform_loops`) one graph per (padded batch, tokens per request, context)
holds loop 0 with the plane index as a device input (`PagedContext.plane_shift`), and is replayed
once per loop of any range (draft loops 1..d, verify d+1..D, plain 1..D). Other families get one
graph per loop index. The readout (norm + head: a few launches) runs eagerly, unless it attends
(Huginn's coda), which gets a graph of its own (per readout depth for non-uniform families).

What a replay reads from the KV cache follows the batch's real context:

* with the paged kernel (`paged_kernel.py`, CUDA + Triton) each query token walks its own blocks up
  to its position; block tables and key counts are device inputs, so one static context of
  `max_model_len` costs nothing beyond the rows' real lengths and one graph serves every length;
* on the reference path (SDPA over copied blocks: CPU emulation, or CUDA without Triton) graphs are
  bucketed by context: the static context is the smallest of `block_size · 2^k` (and finally
  `max_model_len`) holding the batch's longest context, so a request reads fewer than twice its
  batch's longest context. These are prepared (captured) the first time a bucket is used.

Inputs are copied into static buffers allocated once at the largest shape; padding rows write their
keys and values to a scratch block and attend to it only. Embedding runs eagerly (Huginn draws
per-token random initial states on the host). Everything on the captured path is host-sync free.
With `capture=False` (CPU, or for debugging) the same padded static-buffer path runs eagerly, so
bucketing, padding and the plane shift are testable without a GPU.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from looped_spec.execution.attention import PagedContext
from looped_spec.execution.model_runner import StepInput, StepOutput
from looped_spec.execution.paged_kernel import MAX_KERNEL_QUERY, KernelBatch, kernel_available, num_splits_for
from looped_spec.execution.transfers import copy_from_host


@dataclass(frozen=True)
class GraphKey:
    batch: int  # padded number of requests
    query_len: int  # tokens per request (1 for draft/decode, K+1 for verify)
    context: int  # static keys per request (a context bucket)
    stage: str  # "loop" (any loop, plane shift as input), "loop<i>", "readout" or "readout<depth>"


def batch_buckets(max_batch_size: int) -> list[int]:
    """Padded batch sizes to capture: 1, 2, 4, 8, then multiples of 8 up to max_batch_size."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch_size]
    sizes += list(range(16, max_batch_size, 8))
    return sorted(set(sizes + [max_batch_size]))


def context_buckets(max_context: int, block_size: int, per_request_lengths: bool) -> list[int]:
    """Static contexts to prepare: block_size · 2^k below max_context, then max_context rounded up to a block.

    With a kernel that reads each row's own length (`per_request_lengths`), the one static context
    `max_context` serves every length.
    """
    top = -(-max_context // block_size) * block_size
    if per_request_lengths:
        return [top]
    sizes, size = [], block_size
    while size < top:
        sizes.append(size)
        size *= 2
    return sizes + [top]


def pad_to(n: int, buckets: list[int]) -> int | None:
    """Smallest bucket holding `n`; None when `n` is larger than every bucket."""
    for size in buckets:
        if size >= n:
            return size
    return None


pad_batch = pad_to


def query_lens_of(plans: list[tuple[int, int]], use_kernel: bool = False) -> list[int]:
    """Tokens per request of the steps the plans run and graphs capture: 1 (decode, draft) and K + 1 (verify); with
    the paged kernel only up to `MAX_KERNEL_QUERY`, the most its tiles are sized for (the eager runner's rule too:
    longer verify steps run eagerly, on the reference path)."""
    lens = {1} | {k + 1 for k, _ in plans if k > 0}
    return sorted(q for q in lens if not use_kernel or q <= MAX_KERNEL_QUERY)


def graph_stages(plans: list[tuple[int, int]], full_depth: int, uniform_loops: bool, readout_graph: bool) -> list[str]:
    """Captured stages per shape. A readout that does not attend is a norm and one matmul: a few launches,
    run eagerly; one that attends (Huginn's coda) is captured too."""
    loops = ["loop"] if uniform_loops else [f"loop{i}" for i in range(full_depth)]
    if not readout_graph:
        return loops
    if uniform_loops:
        return loops + ["readout"]
    depths = {full_depth} | {d for k, d in plans if k > 0}
    return loops + [f"readout{d}" for d in sorted(depths)]


def graph_keys(
    plans: list[tuple[int, int]],
    full_depth: int,
    batches: list[int],
    contexts: list[int],
    uniform_loops: bool = True,
    readout_graph: bool = False,
    use_kernel: bool = False,
) -> list[GraphKey]:
    """Every graph the plans need; largest first (so later captures fit in the shared pool)."""
    stages = graph_stages(plans, full_depth, uniform_loops, readout_graph)
    query_lens = query_lens_of(plans, use_kernel)
    keys = [GraphKey(b, q, c, s) for b in batches for q in query_lens for c in contexts for s in stages]
    return sorted(keys, key=lambda k: (-k.batch * k.query_len * k.context, k.stage))


class SharedBuffers:
    """Input buffers allocated once at the largest shape; every StaticBatch takes views of them."""

    def __init__(self, max_tokens: int, max_batch: int, max_context: int, block_size: int, with_mask: bool,
                 state_dim: int, dtype, device) -> None:  # fmt: skip
        self.token_ids = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.state = torch.zeros(max_tokens, state_dim, dtype=dtype, device=device)
        self.positions = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.slot_mapping = torch.zeros(max_tokens, dtype=torch.long, device=device)
        self.block_table = torch.zeros(max_batch * (max_context // block_size), dtype=torch.long, device=device)
        self.key_limit = torch.ones(max_tokens, dtype=torch.int32, device=device)
        self.mask = torch.zeros(max_tokens * max_context if with_mask else 0, dtype=torch.bool, device=device)
        self.plane_shift = torch.zeros(1, dtype=torch.long, device=device)  # loop planes added in "loop" graphs


class StaticBatch:
    """Static-shape views of the shared buffers and the contexts over them, for one (batch, query_len, context)."""

    def __init__(self, batch: int, query_len: int, context: int, buffers: SharedBuffers, kv, scratch_block: int,
                 use_kernel: bool) -> None:  # fmt: skip
        n = batch * query_len
        bs = kv.block_size
        self.batch, self.query_len, self.context = batch, query_len, context
        self.scratch_block = scratch_block
        self.token_ids = buffers.token_ids[:n]
        self.state = buffers.state[:n]  # [batch * q, state_dim]
        self.positions = buffers.positions[:n]
        self.slot_mapping = buffers.slot_mapping[:n]
        self.block_table = buffers.block_table[: batch * (context // bs)].view(batch, context // bs)
        self.key_limit = buffers.key_limit[:n]
        kernel = None
        self.mask = None
        if use_kernel:
            device = self.state.device
            query_start = torch.arange(0, n, query_len, dtype=torch.int32, device=device)  # fixed per shape
            query_lens = torch.full((batch,), query_len, dtype=torch.int32, device=device)
            kernel = KernelBatch(
                self.block_table, query_start, query_lens, self.key_limit, bs, query_len, num_splits_for(context // bs)
            )
        else:
            self.mask = buffers.mask[: n * context].view(batch, 1, query_len, context)
        # a safe state for warm-up and capture: every row writes to and attends to the scratch block
        self.slot_mapping.fill_(scratch_block * bs)
        self.block_table.fill_(scratch_block)
        self.key_limit.fill_(1)
        if self.mask is not None:
            self.mask.zero_()
            self.mask[..., 0] = True

        def context_for(shift):
            return PagedContext(
                self.positions, self.slot_mapping, self.block_table, context, self.mask, None, batch, query_len,
                kv.key_cache, kv.value_cache, bs, kernel=kernel, plane_shift=shift,
            )  # fmt: skip

        self.kernel = kernel
        self.loop_ctx = context_for(buffers.plane_shift)  # "loop" graphs: planes moved by the shift
        self.ctx = context_for(None)  # embed, readout and per-index loop graphs

    def fill(self, block_tables: list[list[int]], context_lens: list[int], block_size: int,
             seeds: list[int] | None) -> None:  # fmt: skip
        """Copy one batch's indices into the static buffers (host-built, one copy per buffer)."""
        batch, q, context = self.batch, self.query_len, self.context
        num_reqs = len(context_lens)
        table = torch.full((batch, context // block_size), self.scratch_block, dtype=torch.long)
        for r, blocks in enumerate(block_tables):
            used = blocks[: -(-context_lens[r] // block_size)]
            table[r, : len(used)] = torch.tensor(used, dtype=torch.long)
        ctx_lens = torch.ones(batch, dtype=torch.long)
        ctx_lens[:num_reqs] = torch.tensor(context_lens)
        start = (ctx_lens - q).clamp_min(0)
        q_pos = start[:, None] + torch.arange(q)[None, :]  # [batch, q]
        real = (torch.arange(batch) < num_reqs)[:, None].expand(-1, q)
        q_pos = torch.where(real, q_pos, 0)  # padding rows sit at position 0 of the scratch block
        slots = table.gather(1, q_pos // block_size) * block_size + q_pos % block_size
        copy_from_host(self.positions, q_pos.reshape(-1))
        copy_from_host(self.slot_mapping, slots.reshape(-1))
        copy_from_host(self.block_table, table)
        copy_from_host(self.key_limit, (q_pos + 1).reshape(-1))
        if self.mask is not None:
            mask = torch.arange(context)[None, None, :] <= q_pos[:, :, None]  # padding rows: key 0 only
            copy_from_host(self.mask, mask[:, None])
        if seeds is not None:
            pos = q_pos.reshape(-1).tolist()
            seeds = list(seeds) + [0] * (batch - num_reqs)
            token_seeds = [(seeds[i // q], pos[i]) for i in range(len(pos))]
            self.ctx.seeds_per_token = self.loop_ctx.seeds_per_token = token_seeds
        self.ctx.memo.clear()
        self.loop_ctx.memo.clear()


class CudaGraphRunner:
    """Captures and replays loop iterations and readouts for every shape the active plans run."""

    def __init__(
        self,
        adapter,
        kv,
        max_context: int,
        buckets: list[int],
        plans: list[tuple[int, int]],
        capture: bool = True,
        use_kernel: bool | None = None,
    ) -> None:
        self.adapter = adapter
        self.kv = kv
        self.block_size = kv.block_size
        if use_kernel is None:
            use_kernel = kernel_available(adapter.device, adapter.kv_layout.head_dim)
        self.use_kernel = use_kernel
        self.contexts = context_buckets(max_context, kv.block_size, per_request_lengths=use_kernel)
        self.max_context = self.contexts[-1]
        self.buckets = buckets
        self.capture = capture
        self.uniform_loops = adapter.uniform_loops
        self.readout_graph = adapter.readout_uses_kv
        layout = adapter.kv_layout
        self.planes_per_loop = layout.num_loop_planes // adapter.full_depth
        self.scratch_block = kv.scratch_block  # padding rows write to and read from it only
        self.plans = sorted(set(plans))
        self.query_lens = query_lens_of(self.plans, use_kernel)
        self.buffers = SharedBuffers(
            max(buckets) * max(self.query_lens), max(buckets), self.max_context, self.block_size, not use_kernel,
            adapter.state_dim, adapter.dtype, adapter.device,
        )  # fmt: skip
        self.pool = None
        self.batches: dict[tuple[int, int, int], StaticBatch] = {}
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[GraphKey, torch.Tensor] = {}
        self.prepared: set[GraphKey] = set()
        self.capture_seconds = 0.0
        self.capture_bytes = 0
        if use_kernel:  # one static context: capture every shape the plans run up front, as vLLM does
            for key in self.keys(self.contexts):
                self.prepare(key)

    # ----- preparing -----
    def keys(self, contexts: list[int]) -> list[GraphKey]:
        return graph_keys(
            self.plans, self.adapter.full_depth, self.buckets, contexts, self.uniform_loops, self.readout_graph,
            self.use_kernel,
        )  # fmt: skip

    def static_batch(self, batch: int, query_len: int, context: int) -> StaticBatch:
        shape = (batch, query_len, context)
        if shape not in self.batches:
            self.batches[shape] = StaticBatch(
                batch, query_len, context, self.buffers, self.kv, self.scratch_block, self.use_kernel
            )
        return self.batches[shape]

    def prepare(self, key: GraphKey) -> None:
        """Capture one graph (warm-up first, so lazy initialisation and autotuning stay outside)."""
        if key in self.prepared:
            return
        static = self.static_batch(key.batch, key.query_len, key.context)
        self.prepared.add(key)
        if not self.capture:
            return
        device = self.adapter.device
        mem0 = torch.cuda.memory_allocated(device)
        t0 = time.perf_counter()
        with torch.inference_mode():
            # a bucket prepared mid-run holds a live batch: warm-up must not advance its state
            saved = static.state.clone()
            self._body(key, static)
            static.state.copy_(saved)
            torch.cuda.synchronize(device)
            # tensors memoised during warm-up (RoPE tables) were computed eagerly: recompute them in-graph
            static.ctx.memo.clear()
            static.loop_ctx.memo.clear()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool):
                self.outputs[key] = self._body(key, static)
        self.pool = graph.pool()  # one memory pool shared by every graph
        self.graphs[key] = graph
        torch.cuda.synchronize(device)
        self.capture_bytes += torch.cuda.memory_allocated(device) - mem0
        self.capture_seconds += time.perf_counter() - t0

    def _body(self, key: GraphKey, static: StaticBatch) -> torch.Tensor:
        """The captured computation. Loop stages update `static.state` in place; readouts return logits."""
        if key.stage == "loop":
            static.state.copy_(self.adapter.loop(static.state, 0, static.loop_ctx))
            return static.state
        if key.stage.startswith("loop"):
            static.state.copy_(self.adapter.loop(static.state, int(key.stage[4:]), static.ctx))
            return static.state
        depth = self.adapter.full_depth if key.stage == "readout" else int(key.stage[7:])
        return self.adapter.readout(static.state, depth, static.ctx)

    @property
    def num_graphs(self) -> int:
        """Graphs prepared so far (captured on CUDA; the same count in emulation)."""
        return len(self.prepared)

    # ----- running -----
    def step(self, inp: StepInput) -> StepOutput | None:
        """StepRunner entry: replay when this shape is covered; decline ragged batches, kept states and other
        shapes (the eager runner takes them)."""
        if inp.keep_states or inp.query_len is None:
            return None
        shape = self.supports(len(inp.requests), inp.query_len, max(inp.context_lens))
        if shape is None:
            return None
        return self.run(shape, inp)

    def supports(self, num_reqs: int, query_len: int, max_context: int) -> tuple[int, int, int] | None:
        batch = pad_to(num_reqs, self.buckets)
        context = pad_to(max_context, self.contexts)
        if batch is None or context is None or query_len not in self.query_lens:
            return None
        return batch, query_len, context

    def _replay(self, key: GraphKey, static: StaticBatch) -> torch.Tensor:
        self.prepare(key)
        if not self.capture:
            return self._body(key, static)
        self.graphs[key].replay()
        return self.outputs[key]

    @torch.inference_mode()
    def run(self, shape: tuple[int, int, int], inp: StepInput) -> StepOutput:
        """Embed `inp.tokens` (or take `inp.state`) for the real rows, run loops [start, end), read out at `end`."""
        batch, query_len, context = shape
        requests, start, end = inp.requests, inp.start, inp.end
        static = self.static_batch(batch, query_len, context)
        seeds = [r.seed for r in requests] if self.adapter.needs_token_seeds else None
        static.fill([r.block_table for r in requests], inp.context_lens, self.block_size, seeds)
        n = len(requests) * query_len
        if inp.tokens is not None:
            static.token_ids.zero_()
            static.token_ids[:n].copy_(inp.tokens)
            static.state.copy_(self.adapter.embed(static.token_ids, static.ctx))
        else:
            static.state[:n].copy_(inp.state)
        for i in range(start, end):
            if self.uniform_loops:
                self.buffers.plane_shift.fill_(i * self.planes_per_loop)
                self._replay(GraphKey(batch, query_len, context, "loop"), static)
            else:
                self._replay(GraphKey(batch, query_len, context, f"loop{i}"), static)
        out_state = static.state[:n].clone()  # the next step overwrites the static buffers
        if not inp.readout:
            return StepOutput(out_state, None)
        if self.readout_graph:
            stage = "readout" if self.uniform_loops else f"readout{end}"
            logits = self._replay(GraphKey(batch, query_len, context, stage), static)
        else:
            logits = self.adapter.readout(static.state, end, static.ctx)
        return StepOutput(out_state, logits[:n].clone())  # outputs live in the shared graph pool
