"""Captured loop passes: one CUDA graph replays one loop of a ragged set of items, each at its own loop.

A loop of a family with `uniform_loops` is loop 0's computation on moved KV planes, and the paged kernel reads each
request's own plane (`KernelBatch.attend(..., request_planes)`) and each token's own keys: so one graph per shape
serves every mix of loops, positions and contexts. The shape is (items, positions, most positions of one item),
each padded to a bucket (`pass_shape`); a pass's positions, slots, block tables, key limits and planes are device
inputs, copied into buffers allocated once at the largest shape. Graphs are captured on first use.

Masked writes (early exit's skip mode keeps an exited row's cached KV in the deeper planes) become writes to the
scratch block: the row's slot is moved there, so the captured computation never depends on how many rows write.
Padding items have no query tokens (the kernel computes nothing for them); padding positions belong to no item,
write their KV to the scratch block, and their rows (each row's computation is its own) are never read.

A readout that attends (Huginn's coda: it writes the coda KV of the positions it reads out) is a stage of its own,
captured per shape the same way on buffers of its own (`read_out`): a pass's readouts run between and after its loops,
whose inputs stay loaded. So is an exit rule that reads out through attention (Huginn's KL rule: a coda readout and a
divergence over the vocabulary, after every loop), with its previous states, carries and thresholds as inputs
(`exit_rule`). `CapturedStages` is the model runner loop passes use then: its readouts and rule calls replay these
graphs where they fit. A readout that does not attend (a norm and the head: a few launches) and a rule that does not
read out run eagerly, as in steps.

Passes outside the buckets (a prompt chunk longer than the kernel's query limit, more items or positions than the
largest bucket) run eagerly. `capture=False` ("emulate") runs the same padded static-buffer path without capture; with
`use_kernel=False` the kernel's contract is computed in plain torch (`TorchKernelBatch`), which is how the CPU tests
drive this path (the Triton kernel itself runs there in Triton's interpreter).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch

from looped_spec.execution.attention import PagedContext
from looped_spec.execution.cuda_graph import batch_buckets, pad_to
from looped_spec.execution.paged_kernel import MAX_KERNEL_QUERY, KernelBatch, TorchKernelBatch, num_splits_for
from looped_spec.execution.transfers import to_device

QUERY_BUCKETS = (1, 2, 4, 8, MAX_KERNEL_QUERY)  # most positions of one item in a pass


def position_buckets(max_positions: int) -> list[int]:
    """Padded position counts: powers of two from 8, then the largest."""
    sizes, n = [], 8
    while n < max_positions:
        sizes.append(n)
        n *= 2
    return sizes + [max_positions]


@dataclass(frozen=True)
class PassShape:
    items: int
    positions: int
    max_query: int


class _Buffers:
    """The inputs of every captured pass, at the largest shape; each shape takes leading views."""

    def __init__(self, max_items: int, max_positions: int, max_blocks: int, state_dim: int, dtype, device) -> None:
        long, int32 = torch.long, torch.int32
        self.state = torch.zeros(max_positions, state_dim, dtype=dtype, device=device)
        self.positions = torch.zeros(max_positions, dtype=long, device=device)
        self.slot_mapping = torch.zeros(max_positions, dtype=long, device=device)
        self.key_limit = torch.ones(max_positions, dtype=int32, device=device)
        self.token_planes = torch.zeros(max_positions, dtype=long, device=device)
        self.block_table = torch.zeros(max_items * max_blocks, dtype=long, device=device)
        self.query_start = torch.zeros(max_items, dtype=int32, device=device)
        self.query_len = torch.zeros(max_items, dtype=int32, device=device)
        self.request_planes = torch.zeros(max_items, dtype=long, device=device)


class _Stage:
    """One captured stage: its static inputs (an exit rule's: also previous states, carries and thresholds), a
    context and a graph per shape, and each graph's outputs (readouts, rules)."""

    def __init__(self, buffers: _Buffers, rule_inputs: dict[str, torch.Tensor] | None = None) -> None:
        self.buffers = buffers
        self.rule_inputs = rule_inputs
        self.contexts: dict[PassShape, PagedContext] = {}
        self.graphs: dict[PassShape, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[PassShape, Any] = {}


class LoopPassGraphs:
    """One loop of a pass's items, replayed from a graph per padded `PassShape` (or run on the static buffers)."""

    def __init__(self, adapter, kv, max_context: int, max_items: int, capture: bool = True, use_kernel: bool = True
                 ) -> None:  # fmt: skip
        if not adapter.uniform_loops:
            raise ValueError(f"{adapter.model_type}: captured loop passes need loops that differ only in their planes")
        if capture and not use_kernel:
            raise ValueError("captured loop passes need the paged kernel (its torch stand-in reads inputs on the host)")
        self.adapter, self.kv, self.capture = adapter, kv, capture
        self.kernel_class = KernelBatch if use_kernel else TorchKernelBatch
        self.block_size = bs = kv.block_size
        self.max_blocks = -(-max_context // bs)
        self.item_buckets = batch_buckets(max_items)
        self.position_buckets = position_buckets(max_items * MAX_KERNEL_QUERY)
        self.scratch_slot = kv.scratch_block * bs
        self.loops = _Stage(self._buffers(max_items))
        # a readout that attends writes KV: captured too, on inputs of its own (a pass's loops keep theirs loaded)
        self.readouts = _Stage(self._buffers(max_items)) if adapter.readout_uses_kv else None
        # an exit rule that reads out writes KV too; one graph serves every depth when the rule ignores it (its inputs
        # are allocated on its first call: Huginn's carry is a row of the vocabulary per position)
        reads = adapter.exit_rule_reads_kv and not adapter.exit_rule_uses_depth
        self.rules = _Stage(self._buffers(max_items)) if reads else None
        self.pool = None
        self.capture_seconds = 0.0
        self.num_replays = 0  # loops replayed
        self.num_readout_replays = 0
        self.num_rule_replays = 0

    def _buffers(self, max_items: int) -> _Buffers:
        adapter = self.adapter
        return _Buffers(max_items, self.position_buckets[-1], self.max_blocks, adapter.state_dim, adapter.dtype,
                        adapter.device)  # fmt: skip

    @property
    def num_graphs(self) -> int:
        return sum(len(stage.contexts) for stage in (self.loops, self.readouts, self.rules) if stage is not None)

    def pass_shape(self, counts: list[int]) -> PassShape | None:
        """The padded shape of a pass whose items have `counts` positions each, or None (it runs eagerly)."""
        items, query = pad_to(len(counts), self.item_buckets), pad_to(max(counts), list(QUERY_BUCKETS))
        positions = pad_to(sum(counts), self.position_buckets)
        if items is None or query is None or positions is None:
            return None
        return PassShape(items, positions, query)

    def load(self, shape: PassShape, ctx: PagedContext, counts: list[int], stage: _Stage | None = None) -> None:
        """Copy the pass's context (its positions, slots and block tables, built eagerly) into the static buffers of
        `stage` (the loops'), with the kernel's per-item inputs; padding rows and items point at the scratch block."""
        stage = stage or self.loops
        b, n, items = stage.buffers, sum(counts), len(counts)
        lens = torch.tensor(counts, dtype=torch.int32)
        starts_lens = to_device(torch.cat([torch.cumsum(lens, 0, dtype=torch.int32) - lens, lens]), b.positions.device)
        b.positions[n : shape.positions].zero_()
        b.positions[:n].copy_(ctx.positions)
        b.slot_mapping[: shape.positions].fill_(self.scratch_slot)
        b.slot_mapping[:n].copy_(ctx.slot_mapping)
        b.key_limit[: shape.positions].fill_(1)
        b.key_limit[:n].copy_(ctx.positions + 1)
        table = b.block_table[: shape.items * self.max_blocks].view(shape.items, self.max_blocks)
        table.fill_(self.kv.scratch_block)
        table[:items, : ctx.block_table.shape[1]].copy_(ctx.block_table)
        b.query_start[: shape.items].fill_(n)
        b.query_start[:items].copy_(starts_lens[:items])
        b.query_len[: shape.items].zero_()  # padding items: no query tokens, no program does anything
        b.query_len[:items].copy_(starts_lens[items:])
        b.token_planes[: shape.positions].zero_()
        b.request_planes[: shape.items].zero_()
        self._context(shape, stage).memo.clear()  # RoPE tables of the last positions loaded

    def run(self, shape: PassShape, state: torch.Tensor, request_planes: torch.Tensor, token_planes: torch.Tensor,
            write: torch.Tensor | None) -> torch.Tensor:  # fmt: skip
        """One loop of the loaded pass: item i's rows at plane offset `request_planes[i]`; rows where `write` is False
        keep their cached KV (their write goes to the scratch block)."""
        stage = self.loops
        b, n = stage.buffers, state.shape[0]
        b.request_planes[: request_planes.shape[0]].copy_(request_planes)
        b.token_planes[:n].copy_(token_planes)
        if write is not None:
            slots = b.slot_mapping[:n]
            slots.copy_(torch.where(write, slots, self.scratch_slot))
        b.state[:n].copy_(state)
        self._replay(stage, shape, self._loop_body)
        self.num_replays += 1
        return b.state[:n].clone()  # the next pass overwrites the buffer

    def read_out(self, state: torch.Tensor, ctx: PagedContext) -> torch.Tensor | None:
        """The logits of a readout that attends over `state` (the rows of `ctx`'s positions), replayed from the
        readout graph of its padded shape; None where there is none (a readout that does not attend, a context of
        unknown query lengths, a shape outside the buckets): the caller reads out eagerly."""
        shape = self._loaded(self.readouts, state, ctx)
        if shape is None:
            return None
        logits = self._replay(self.readouts, shape, self._readout_body)
        self.num_readout_replays += 1
        return logits[: state.shape[0]].clone()  # the next readout overwrites the output

    def exit_rule(self, state: torch.Tensor, prev: torch.Tensor, carry: torch.Tensor | None, threshold: torch.Tensor,
                  ctx: PagedContext) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:  # fmt: skip
        """The exit rule's (hits, carry, logits) over `state` (the rows of `ctx`'s positions), replayed from the rule
        graph of its padded shape; None where there is none (no rule stage, no carry, unknown query lengths, a shape
        outside the buckets): the caller runs the rule eagerly."""
        stage = self.rules
        shape = None if carry is None else self._loaded(stage, state, ctx)
        if shape is None:
            return None
        if stage.rule_inputs is None:
            rows, adapter = self.position_buckets[-1], self.adapter
            stage.rule_inputs = {
                "prev": torch.zeros(rows, adapter.state_dim, dtype=adapter.dtype, device=adapter.device),
                "carry": torch.zeros(rows, *carry.shape[1:], dtype=carry.dtype, device=adapter.device),
                "threshold": torch.zeros(rows, dtype=torch.float32, device=adapter.device),
            }
        n, inputs = state.shape[0], stage.rule_inputs
        inputs["prev"][:n].copy_(prev)
        inputs["carry"][:n].copy_(carry)
        inputs["threshold"][:n].copy_(threshold)
        hits, new_carry, logits = self._replay(stage, shape, self._rule_body)
        self.num_rule_replays += 1
        return hits[:n].clone(), new_carry[:n].clone(), None if logits is None else logits[:n].clone()

    def _loaded(self, stage: _Stage | None, state: torch.Tensor, ctx: PagedContext) -> PassShape | None:
        """Load a readout's or rule's context and state (the rows of the context's positions) into `stage`'s buffers;
        its padded shape, or None where it has none (no such stage, unknown query lengths, outside the buckets)."""
        counts = ctx.query_lens
        shape = None if stage is None or counts is None else self.pass_shape(counts)
        if shape is not None:
            self.load(shape, ctx, counts, stage)
            stage.buffers.state[: state.shape[0]].copy_(state)
        return shape

    def _replay(self, stage: _Stage, shape: PassShape, body) -> Any:
        """Run `body` (stage, shape, context) -> output or None on the loaded buffers: replayed from its graph (captured
        on first use), or eagerly when emulating."""
        ctx = self._context(shape, stage)
        if not self.capture:
            return body(stage, shape, ctx)
        if shape not in stage.graphs:
            self._capture(stage, shape, ctx, body)
        stage.graphs[shape].replay()
        return stage.outputs.get(shape)

    def _context(self, shape: PassShape, stage: _Stage) -> PagedContext:
        ctx = stage.contexts.get(shape)
        if ctx is None:
            b, kv = stage.buffers, self.kv
            table = b.block_table[: shape.items * self.max_blocks].view(shape.items, self.max_blocks)
            kernel = self.kernel_class(table, b.query_start[: shape.items], b.query_len[: shape.items],
                                       b.key_limit[: shape.positions], self.block_size, shape.max_query,
                                       num_splits_for(self.max_blocks))  # fmt: skip
            ctx = PagedContext(
                b.positions[: shape.positions], b.slot_mapping[: shape.positions], table,
                self.max_blocks * self.block_size, None, None, shape.items, shape.max_query, kv.key_cache,
                kv.value_cache, self.block_size, kernel=kernel, request_planes=b.request_planes[: shape.items],
                token_planes=b.token_planes[: shape.positions],
            )  # fmt: skip
            stage.contexts[shape] = ctx
        return ctx

    def _loop_body(self, stage: _Stage, shape: PassShape, ctx: PagedContext) -> None:
        state = stage.buffers.state[: shape.positions]
        state.copy_(self.adapter.loop(state, 0, ctx))

    def _readout_body(self, stage: _Stage, shape: PassShape, ctx: PagedContext) -> torch.Tensor:
        # the depth does not change the readout of a family with uniform loops (ModelAdapter.uniform_loops)
        return self.adapter.readout(stage.buffers.state[: shape.positions], self.adapter.full_depth, ctx)

    def _rule_body(self, stage: _Stage, shape: PassShape, ctx: PagedContext) -> tuple:
        # a rule captured once for every depth ignores it (`exit_rule_uses_depth` False)
        n, inputs = shape.positions, stage.rule_inputs
        return self.adapter.exit_rule(stage.buffers.state[:n], self.adapter.full_depth, inputs["prev"][:n],
                                      inputs["carry"][:n], inputs["threshold"][:n], ctx)  # fmt: skip

    def _capture(self, stage: _Stage, shape: PassShape, ctx: PagedContext, body) -> None:
        """Capture on first use: a warm-up on the live inputs (the same computation the replay then runs again,
        writing the same KV), then the capture."""
        device = self.adapter.device
        t0 = time.perf_counter()
        saved = stage.buffers.state[: shape.positions].clone()
        body(stage, shape, ctx)  # lazy initialisation and Triton's compilation stay outside the graph
        stage.buffers.state[: shape.positions].copy_(saved)
        torch.cuda.synchronize(device)
        ctx.memo.clear()  # tensors memoised eagerly (RoPE tables) are recomputed inside the graph
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool):
            output = body(stage, shape, ctx)
        self.pool = graph.pool()
        stage.graphs[shape] = graph
        if output is not None:
            stage.outputs[shape] = output
        torch.cuda.synchronize(device)
        self.capture_seconds += time.perf_counter() - t0


class CapturedStages:
    """The model runner of loop passes whose readouts or exit rule attend: a readout or rule call replays its captured
    graph where its shape fits one (`LoopPassGraphs.read_out`, `.exit_rule`), else runs eagerly; everything else is
    the runner's."""

    def __init__(self, runner, graphs: LoopPassGraphs) -> None:
        # private names: every other attribute is the runner's (its own `graphs` are the step engine's)
        self._runner = runner
        self._pass_graphs = graphs

    def __getattr__(self, name: str):
        return getattr(self._runner, name)

    def readout(self, state: torch.Tensor, depth: int, ctx: PagedContext) -> torch.Tensor:
        logits = self._pass_graphs.read_out(state, ctx)
        return self._runner.readout(state, depth, ctx) if logits is None else logits

    def exit_rule(self, state, depth, prev, carry, threshold, ctx):
        decided = self._pass_graphs.exit_rule(state, prev, carry, threshold, ctx)
        return self._runner.exit_rule(state, depth, prev, carry, threshold, ctx) if decided is None else decided
