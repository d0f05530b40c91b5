"""Runs loop ranges of the model over ragged request batches on the paged KV cache."""

from __future__ import annotations

from typing import Protocol

import torch

from looped_spec.adapter import ModelAdapter
from looped_spec.attention import PagedContext, build_paged_context
from looped_spec.early_exit import ExitMode, decode_with_exit, prefill_with_exit
from looped_spec.kv_cache import KVCache
from looped_spec.paged_kernel import MAX_KERNEL_QUERY, kernel_available
from looped_spec.request import Request


class StepRunner(Protocol):
    """One loop-range pass over a batch with `query_len` tokens per request: embed `tokens` (or take
    `state`), run loops [start, end), read out at depth `end`. Returns (state, logits), or None to decline
    the batch (the next runner then takes it)."""

    def step(
        self,
        requests: list[Request],
        query_len: int,
        context_lens: list[int],
        start: int,
        end: int,
        tokens: torch.Tensor | None,
        state: torch.Tensor | None,
        probe,
        readout: bool,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None: ...


class EagerStepRunner:
    """StepRunner for every shape, on any device: builds the batch's context and runs the adapter stages."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def step(self, requests, query_len, context_lens, start, end, tokens, state, probe, readout):
        runner = self.runner
        ctx = runner.context(requests, [query_len] * len(requests), context_lens)
        if tokens is not None:
            state = runner.embed(tokens, ctx)
        state = runner.loops(state, ctx, start, end, probe)
        return state, runner.readout(state, end, ctx) if readout else None


class ModelRunner:
    """Thin stage runner shared by prefill, plain decode, draft and verify.

    Every call handles all requests of the batch together: one `PagedContext` per forward holds
    the index tensors that every loop and layer reuse.
    """

    def __init__(self, adapter: ModelAdapter, kv_cache: KVCache) -> None:
        self.adapter = adapter
        self.kv = kv_cache
        self.device = adapter.device
        self.full_depth = adapter.full_depth
        # Families whose readout attends (Huginn's coda) must read out every position they cache.
        self.readout_writes_kv = adapter.readout_uses_kv
        self.eager = EagerStepRunner(self)
        self.graphs: StepRunner | None = None  # a CudaGraphRunner, when the engine enables graphs
        self.exit_mode: ExitMode = "skip"  # how requests that exit early are run (early_exit.py)
        # the paged kernel reads each token's own keys in place (decode, draft, verify); prefill keeps SDPA
        self.paged_kernel = kernel_available(self.device, kv_cache.layout.head_dim)

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
        return torch.tensor(tokens, dtype=torch.long, device=self.device)

    def embed(self, token_ids: torch.Tensor, ctx: PagedContext) -> torch.Tensor:
        return self.adapter.embed(token_ids, ctx)

    def loops(self, state: torch.Tensor, ctx: PagedContext, start: int, end: int, probe=None) -> torch.Tensor:
        """Run loops start..end-1 (0-based). `probe(depth, state, ctx)` is called after each loop but the last."""
        for i in range(start, end):
            state = self.adapter.loop(state, i, ctx)
            if probe is not None and i + 1 < end:
                probe(i + 1, state, ctx)
        return state

    def readout(self, state: torch.Tensor, depth: int, ctx: PagedContext) -> torch.Tensor:
        return self.adapter.readout(state, depth, ctx)

    def run_uniform(
        self,
        requests: list[Request],
        query_len: int,
        context_lens: list[int],
        start: int,
        end: int,
        tokens: torch.Tensor | None = None,
        state: torch.Tensor | None = None,
        probe=None,
        readout: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(embed tokens | take state) -> loops[start, end) -> readout(end), `query_len` tokens per request.

        Asks the CUDA-graph step runner first (it declines shapes it has not captured, and probes), then
        the eager one. Returns (state, logits); logits may be None when `readout` is False (eager only).
        """
        for step_runner in (self.graphs, self.eager):
            if step_runner is not None:
                out = step_runner.step(requests, query_len, context_lens, start, end, tokens, state, probe, readout)
                if out is not None:
                    return out
        raise RuntimeError("no step runner took the batch")  # unreachable: the eager runner takes everything

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
        ctx = self.context(requests, chunk_lens, context_lens)
        state = self.loops(self.embed(self.token_tensor(tokens), ctx), ctx, 0, self.full_depth)
        last = torch.tensor(chunk_lens, device=self.device).cumsum(0) - 1
        if self.readout_writes_kv:
            return self.readout(state, self.full_depth, ctx)[last]
        return self.readout(state[last], self.full_depth, ctx)

    def decode_with_depths(self, requests: list[Request]) -> tuple[torch.Tensor, list[int] | None]:
        """Plain decode; with requests that exit early, also each request's exit depth (else None)."""
        if any(r.exits_early for r in requests):
            return decode_with_exit(self, requests, self.exit_mode)
        return self.decode(requests), None

    @torch.inference_mode()
    def decode(self, requests: list[Request], depth_preds: torch.Tensor | None = None) -> torch.Tensor:
        """Plain full-depth decode of each request's last token -> logits [num_reqs, V].

        With `depth_preds` ([D - 1, num_reqs]), also stores the argmax readout after each loop 1..D-1
        (counterfactual draft depths; eager path).
        """
        tokens = self.token_tensor([r.token_ids[r.num_computed] for r in requests])
        context_lens = [r.num_computed + 1 for r in requests]
        probe = None
        if depth_preds is not None:

            def probe(depth: int, state: torch.Tensor, ctx) -> None:
                depth_preds[depth - 1] = self.readout(state, depth, ctx).argmax(-1)

        return self.run_uniform(requests, 1, context_lens, 0, self.full_depth, tokens=tokens, probe=probe)[1]
