"""Runs loop ranges of the model over ragged request batches on the paged KV cache."""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field
from typing import Protocol

import torch

from looped_spec.execution.attention import PagedContext, build_paged_context
from looped_spec.execution.early_exit import ExitMode, decode_with_exit, prefill_with_exit
from looped_spec.execution.kv_cache import KVCache
from looped_spec.execution.paged_kernel import MAX_KERNEL_QUERY, kernel_unavailable_reason
from looped_spec.execution.timing import Span
from looped_spec.execution.transfers import to_device
from looped_spec.models.adapter import ModelAdapter
from looped_spec.request import Request

logger = logging.getLogger(__name__)


@dataclass
class StepInput:
    """One loop-range pass over a batch: embed `tokens` (or continue from `state`), run loops [start, end),
    read out at depth `end`.

    Request i brings `query_lens[i]` tokens (flat, request after request), the last of them at position
    `context_lens[i] - 1`. `readout=False` skips the readout. `keep_states=True` also returns the state after
    every loop but the last, for counterfactual readouts at shallower depths; the caller then reads out
    itself, deepest last (a readout that writes KV, Huginn's coda, must leave the step's own depth), so
    `readout` must be False.
    """

    requests: list[Request]
    query_lens: list[int]
    context_lens: list[int]
    start: int
    end: int
    tokens: torch.Tensor | None = None
    state: torch.Tensor | None = None
    readout: bool = True
    keep_states: bool = False

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.state is None):
            raise ValueError("a step takes either tokens to embed or a state to continue")
        if self.keep_states and self.readout:
            raise ValueError("keep_states: the caller reads out (intermediate depths first), so readout=False")

    @property
    def query_len(self) -> int | None:
        """Tokens per request when every request has the same number (None for a ragged batch)."""
        first = self.query_lens[0]
        return first if all(q == first for q in self.query_lens) else None


@dataclass
class StepOutput:
    state: torch.Tensor  # [num_tokens, state_dim] after loop `end`
    logits: torch.Tensor | None  # [num_tokens, V] at depth `end` (None when not read out)
    states: list[torch.Tensor] = field(default_factory=list)  # keep_states: after loops start+1 .. end-1
    ctx: PagedContext | None = None  # the step's context, for the caller's readouts (eager steps)


class StepRunner(Protocol):
    """Runs a StepInput, or returns None to decline it (the next runner then takes it)."""

    def step(self, inp: StepInput) -> StepOutput | None: ...


class EagerStepRunner:
    """StepRunner for every shape, on any device: builds the batch's context and runs the adapter stages."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def step(self, inp: StepInput) -> StepOutput:
        runner = self.runner
        ctx = runner.context(inp.requests, inp.query_lens, inp.context_lens)
        state = runner.embed(inp.tokens, ctx) if inp.tokens is not None else inp.state
        states: list[torch.Tensor] = []
        for i in range(inp.start, inp.end):
            if inp.keep_states and i > inp.start:
                states.append(state)
            state = runner.adapter.loop(state, i, ctx)
        logits = runner.readout(state, inp.end, ctx) if inp.readout else None
        return StepOutput(state, logits, states, ctx)


class ModelRunner:
    """Thin stage runner shared by prefill, plain decode, draft and verify.

    Every call handles all requests of the batch together: one `PagedContext` per forward holds
    the index tensors that every loop and layer reuse.
    """

    def __init__(
        self, adapter: ModelAdapter, kv_cache: KVCache, exit_mode: ExitMode = "skip", graphs: StepRunner | None = None,
        readout_depths: Collection[int] | None = None,
    ) -> None:  # fmt: skip
        self.adapter = adapter
        self.kv = kv_cache
        self.device = adapter.device
        self.full_depth = adapter.full_depth
        self.graphs = graphs  # a CudaGraphRunner: takes the shapes it captured
        self.exit_mode = exit_mode  # how requests that exit early are run (early_exit.py)
        # the depths below full a measured step reads out (counterfactual readouts, speculative/readouts.py): the
        # controller's draft depths; None: every one
        every = range(1, self.full_depth)
        self.readout_depths = frozenset(every if readout_depths is None else readout_depths)
        if not self.readout_depths.issubset(every):
            raise ValueError(f"readout_depths={sorted(self.readout_depths)}: each must be in 1..{self.full_depth - 1}")
        # the paged kernel reads each token's own keys in place (decode, draft, verify); prefill keeps SDPA
        why_not = kernel_unavailable_reason(self.device, kv_cache.layout.head_dim)
        self.paged_kernel = why_not is None
        if why_not is not None and self.device.type == "cuda":  # on a CPU the reference path is the only one
            log = logger.info if "LOOPED_SPEC_PAGED_KERNEL" in why_not else logger.warning  # asked for, or not
            log("paged attention kernel not used (%s): decode attention runs the reference path, slower", why_not)
        # when set, the time inside `run` goes into it (the tuner separates pass time from the rest of a round)
        self.run_span: Span | None = None

    @property
    def eager(self) -> EagerStepRunner:
        """The eager step runner (made per use: holding it would tie the runner into a reference cycle, and an engine
        dropped without `gc.collect()` would keep its KV cache)."""
        return EagerStepRunner(self)

    def context(self, requests: list[Request], query_lens: list[int], context_lens: list[int]) -> PagedContext:
        return build_paged_context(
            self.kv.key_cache,
            self.kv.value_cache,
            self.kv.block_size,
            [r.block_table for r in requests],
            context_lens,
            query_lens,
            seeds=[r.seed for r in requests],
            need_token_seeds=self.adapter.needs_token_seeds,
            use_kernel=self.paged_kernel and max(query_lens) <= MAX_KERNEL_QUERY,
        )

    def token_tensor(self, tokens: list[int]) -> torch.Tensor:
        return to_device(tokens, self.device, torch.long)

    def embed(self, token_ids: torch.Tensor, ctx: PagedContext) -> torch.Tensor:
        return self.adapter.embed(token_ids, ctx)

    def readout(self, state: torch.Tensor, depth: int, ctx: PagedContext) -> torch.Tensor:
        return self.adapter.readout(state, depth, ctx)

    def exit_rule(self, state, depth: int, prev_state, carry, threshold, ctx: PagedContext):
        """The adapter's exit rule (`ModelAdapter.exit_rule`); loop passes may replay it from a graph instead."""
        return self.adapter.exit_rule(state, depth, prev_state, carry, threshold, ctx)

    def run(self, inp: StepInput) -> StepOutput:
        """The one entry point for a loop-range pass, uniform or ragged: the CUDA-graph step runner takes the
        shapes it has captured (uniform, without kept states), the eager one everything else."""
        span = self.run_span
        if span is not None:
            span.start()
        out = self.graphs.step(inp) if self.graphs is not None else None
        if out is None:
            out = self.eager.step(inp)
        if span is not None:
            span.stop()
        return out

    # ----- whole steps -----
    @torch.inference_mode()
    def prefill(self, requests: list[Request], chunk_lens: list[int]) -> torch.Tensor:
        """Compute KV for each request's next chunk at full depth; logits [num_reqs, V] at each chunk's end."""
        return self.prefill_with_depths(requests, chunk_lens)[0]

    def prefill_with_depths(self, requests: list[Request], chunk_lens: list[int]) -> tuple[torch.Tensor, list]:
        """`prefill`, plus the exit depth of each completed request's last token (None: no early exit)."""
        if any(r.exits_early or r.exit_depths for r in requests):
            return prefill_with_exit(self, requests, chunk_lens, self.exit_mode)
        return self._prefill_full_depth(requests, chunk_lens), [None] * len(requests)

    @torch.inference_mode()
    def _prefill_full_depth(self, requests: list[Request], chunk_lens: list[int]) -> torch.Tensor:
        tokens: list[int] = []
        context_lens = []
        for request, n in zip(requests, chunk_lens):
            tokens.extend(request.token_ids[request.num_computed : request.num_computed + n])
            context_lens.append(request.num_computed + n)
        ids = self.token_tensor(tokens)
        out = self.eager.step(StepInput(requests, chunk_lens, context_lens, 0, self.full_depth, ids, readout=False))
        # prompt chunks run eagerly (the graphs hold decode-shaped steps); read out each chunk's last token
        last = to_device(chunk_lens, self.device).cumsum(0) - 1
        if self.adapter.readout_uses_kv:  # a readout that attends (Huginn's coda) must cache every position
            return self.readout(out.state, self.full_depth, out.ctx)[last]
        return self.readout(out.state[last], self.full_depth, out.ctx)

    def decode_with_depths(self, requests: list[Request]) -> tuple[torch.Tensor, list[int] | None]:
        """Plain decode; with requests that exit early, also each request's exit depth (else None)."""
        if any(r.exits_early for r in requests):
            return decode_with_exit(self, requests, self.exit_mode)
        return self.decode(requests), None

    def decode_input(self, requests: list[Request], keep_states: bool = False) -> StepInput:
        """The plain full-depth decode step of each request's last token (`keep_states`: for depth readouts)."""
        tokens = self.token_tensor([r.token_ids[r.num_computed] for r in requests])
        context_lens = [r.num_computed + 1 for r in requests]
        return StepInput(
            requests, [1] * len(requests), context_lens, 0, self.full_depth, tokens=tokens,
            readout=not keep_states, keep_states=keep_states,
        )  # fmt: skip

    @torch.inference_mode()
    def decode(self, requests: list[Request]) -> torch.Tensor:
        """Plain full-depth decode of each request's last token -> logits [num_reqs, V]."""
        return self.run(self.decode_input(requests)).logits
