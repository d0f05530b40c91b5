"""LoopedSpecEngine: the user API and the step loop (schedule -> run -> commit -> feedback)."""

from __future__ import annotations

import itertools
import random
import time
from typing import Any

import torch

from looped_spec.adapter import ModelAdapter, load_adapter
from looped_spec.control.factory import make_controller, plan_shapes
from looped_spec.cuda_graph import CudaGraphRunner, batch_buckets
from looped_spec.inputs import load_tokenizer, normalize_prompts, to_token_ids
from looped_spec.kv_cache import KVCache
from looped_spec.model_runner import ModelRunner
from looped_spec.plan import RoundFeedback
from looped_spec.request import Request, RequestOutput
from looped_spec.sampler import SamplingRows, sample
from looped_spec.sampling_params import SamplingParams
from looped_spec.scheduler import Scheduler
from looped_spec.spec.round import SpeculativeRound
from looped_spec.stats import EngineStats


class LoopedSpecEngine:
    """Serve a looped model with continuous batching and (adaptive) self-speculative decoding.

    `model` is a checkpoint folder, a shipped model name, or a ModelAdapter. `speculation` is
    "off", "adaptive", a `SpeculativeConfig(k, d)`, or a "K,d" string.
    """

    def __init__(
        self,
        model: str | ModelAdapter,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        speculation: Any = "adaptive",
        max_batch_size: int = 32,
        max_model_len: int | None = None,
        adapter_options: dict | None = None,
        seed: int = 0,
        *,
        preset: Any = None,
        policy: str = "ema",
        trace_path: str | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        max_num_batched_tokens: int = 1024,
        cuda_graphs: bool | str | None = None,
        draft_override=None,
    ) -> None:
        if isinstance(model, ModelAdapter):
            if adapter_options:
                raise ValueError("adapter_options apply when loading a checkpoint, not to a ModelAdapter instance")
            self.adapter = model
        else:
            self.adapter = load_adapter(model, dtype=dtype, device=device, **(adapter_options or {}))
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
        if max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens={max_num_batched_tokens} must be >= 1")
        limit = self.adapter.max_positions
        self.max_model_len = max_model_len or limit
        if not 2 <= self.max_model_len <= limit:
            raise ValueError(f"max_model_len={max_model_len} must be in [2, {limit}] (the model's max positions)")
        self.controller = make_controller(
            speculation, self.adapter, preset=preset, policy=policy, trace_path=trace_path
        )
        self.max_batch_size = max_batch_size
        self.kv = KVCache(
            self.adapter.kv_layout,
            self._num_blocks(block_size, num_kv_blocks, kv_cache_memory_gb),
            block_size,
            self.adapter.dtype,
            self.adapter.device,
        )
        self.scheduler = Scheduler(self.kv, max_batch_size, max_num_batched_tokens)
        self.runner = ModelRunner(self.adapter, self.kv)
        self._setup_graphs(cuda_graphs)
        self.spec_round = SpeculativeRound(self.runner, draft_override)
        self.tokenizer = load_tokenizer(self.adapter.path)
        self.stats = EngineStats()
        self._rng = random.Random(seed)
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self._aborted: list[Request] = []

    def _num_blocks(self, block_size: int, num_kv_blocks: int | None, memory_gb: float | None) -> int:
        per_request = (self.max_model_len + 64 + block_size - 1) // block_size + 1
        if num_kv_blocks is None:
            per_block = KVCache.bytes_per_block(self.adapter.kv_layout, block_size, self.adapter.dtype)
            if memory_gb is None:
                memory_gb = 2.0
                if self.adapter.device.type == "cuda":
                    memory_gb = 0.5 * torch.cuda.mem_get_info(self.adapter.device)[0] / 2**30
            num_kv_blocks = min(int(memory_gb * 2**30) // per_block, per_request * self.max_batch_size)
        min_blocks = (self.max_model_len + block_size - 1) // block_size + 1
        if num_kv_blocks < min_blocks:
            raise ValueError(
                f"KV cache of {num_kv_blocks} blocks cannot hold one request of max_model_len="
                f"{self.max_model_len} ({min_blocks} blocks); lower max_model_len or give more memory"
            )
        return num_kv_blocks

    def _setup_graphs(self, cuda_graphs: bool | str | None) -> None:
        """None = on for CUDA devices. "emulate" runs the padded static-buffer path eagerly (any device)."""
        on_cuda = self.adapter.device.type == "cuda"
        if cuda_graphs is None:
            cuda_graphs = on_cuda
        if cuda_graphs is False:
            return
        if cuda_graphs is True and not on_cuda:
            raise ValueError("cuda_graphs=True needs a CUDA device; use cuda_graphs='emulate' to test the path on CPU")
        if cuda_graphs not in (True, "emulate"):
            raise ValueError(f"cuda_graphs={cuda_graphs!r}: use None, True, False or 'emulate'")
        self.runner.graphs = CudaGraphRunner(
            self.adapter,
            self.kv,
            self.max_model_len,
            batch_buckets(self.max_batch_size),
            plan_shapes(self.controller),
            capture=cuda_graphs is True,
        )

    # ----- requests -----
    def add_request(
        self, prompt: str | list[int], params: SamplingParams | None = None, request_id: str | None = None
    ) -> str:
        """Validate and queue one request; returns its id. Nothing is queued if validation fails."""
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = to_token_ids(prompt, self.tokenizer, self.adapter.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(ids)} tokens; max_model_len={self.max_model_len} leaves no room to "
                "generate (needs prompt length < max_model_len)"
            )
        request_id = str(next(self._ids)) if request_id is None else str(request_id)
        if request_id in self._requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
        request = Request(
            request_id, len(self._requests), ids, params, seed, self.adapter.eos_token_ids, self.max_model_len
        )
        self._requests[request_id] = request
        self.scheduler.add(request)
        return request_id

    def abort(self, request_id: str) -> None:
        """Stop a request now; its output (finish_reason "abort") comes from the next `step()`."""
        request = self._requests.get(str(request_id))
        if request is None:
            raise KeyError(f"unknown request_id {request_id!r}")
        if request.finished:
            return
        self.scheduler.finish(request, "abort")
        self._aborted.append(request)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ----- the step loop -----
    def step(self) -> list[RequestOutput]:
        """Run one prefill step or one decode round; outputs of requests that advanced or finished."""
        touched: list[Request] = self._aborted
        self._aborted = []
        t0 = time.perf_counter()
        batch = self.scheduler.schedule()
        self.stats.phase_seconds["schedule"] += time.perf_counter() - t0
        if batch is not None:
            if batch.is_prefill:
                touched += self._prefill(batch.requests, batch.chunk_lens)
            else:
                touched += self._decode_round(batch.requests)
        self.stats.num_preemptions = self.scheduler.num_preemptions
        return [self._output(r) for r in dict.fromkeys(touched)]

    def _prefill(self, requests: list[Request], chunk_lens: list[int]) -> list[Request]:
        t0 = time.perf_counter()
        logits = self.runner.prefill(requests, chunk_lens)
        done = [r.num_computed + n == r.num_tokens for r, n in zip(requests, chunk_lens)]
        finishing = [r for r, ok in zip(requests, done) if ok]
        tokens = []
        if finishing:  # sample before any request state changes, so a failure here leaves every request as it was
            rows = [i for i, ok in enumerate(done) if ok]
            tokens = sample(logits[rows], SamplingRows.build(finishing, self.adapter.device)).tolist()
        for request, n in zip(requests, chunk_lens):
            request.num_computed += n
        if finishing:
            for request, token in zip(finishing, tokens):
                request.prefilled = True
                self._commit(request, [token])
        self.stats.num_prefill_steps += 1
        self.stats.num_prompt_tokens += sum(chunk_lens)
        self.stats.phase_seconds["prefill"] += time.perf_counter() - t0
        return finishing

    def _decode_round(self, requests: list[Request]) -> list[Request]:
        t0 = time.perf_counter()
        plan = self.controller.plan(len(requests))
        t1 = time.perf_counter()
        requests, k = self.scheduler.reserve_decode(requests, [plan.k] * len(requests))
        if not requests:
            return []
        if max(k) == 0:
            depth_preds = None
            if plan.measure_depths and self.adapter.full_depth > 1:
                depth_preds = torch.empty(self.adapter.full_depth - 1, len(requests), dtype=torch.long)
                depth_preds = depth_preds.to(self.adapter.device)
            logits = self.runner.decode(requests, depth_preds)
            sampled = sample(logits, SamplingRows.build(requests, self.adapter.device))
            committed = [[t] for t in sampled.tolist()]
            depth_matches, depth_trials = [], []
            if depth_preds is not None:  # how often each shallower depth would have drafted the committed token
                depth_matches = (depth_preds == sampled[None]).sum(dim=1).tolist() + [len(requests)]
                depth_trials = [len(requests)] * self.adapter.full_depth
            t2 = time.perf_counter()
            accepted = [0] * len(requests)
            draft_time, verify_time = 0.0, t2 - t1
            self.stats.phase_seconds["decode"] += t2 - t1
        else:
            result = self.spec_round.run(requests, k, plan.d, plan.measure_depths)
            committed, accepted = result.committed, result.num_accepted
            draft_time, verify_time = result.draft_time, result.verify_time + result.accept_time
            depth_matches, depth_trials = result.depth_matches, result.depth_trials
            self.stats.num_spec_rounds += 1
            self.stats.phase_seconds["draft"] += result.draft_time
            self.stats.phase_seconds["verify"] += result.verify_time
            self.stats.phase_seconds["accept"] += result.accept_time
            t2 = time.perf_counter()
        for request, tokens, kr, a in zip(requests, committed, k, accepted):
            request.metrics.rounds += 1
            request.metrics.num_draft_tokens += kr
            request.metrics.num_accepted_tokens += a
            self._commit(request, tokens)
        t3 = time.perf_counter()
        self.stats.num_rounds += 1
        self.stats.num_draft_tokens += sum(k)
        self.stats.num_accepted_tokens += sum(accepted)
        self.stats.batch_size_histogram[len(requests)] += 1
        self.stats.plan_histogram[f"{max(k)},{plan.d if max(k) else 0}"] += 1
        self.controller.observe(
            RoundFeedback(
                plan.plan_id,
                plan.k,
                plan.d,
                plan.bucket,
                plan.candidate,
                len(requests),
                k,
                accepted,
                draft_time,
                verify_time,
                t3 - t2,
                depth_matches,
                depth_trials,
            )
        )
        t4 = time.perf_counter()
        self.stats.phase_seconds["commit"] += t3 - t2
        self.stats.phase_seconds["control"] += (t1 - t0) + (t4 - t3)
        return requests

    def _commit(self, request: Request, tokens: list[int]) -> None:
        """Append committed tokens (stopping at a stop token or limit); KV now covers all but the last."""
        num_new = 0
        finished = False
        for token in tokens:
            num_new += 1
            if request.append(token):
                finished = True
                break
        self.stats.num_generation_tokens += num_new
        if finished:
            self.scheduler.finish(request)
            self.stats.num_requests_finished += 1
            return
        request.num_computed = request.num_tokens - 1
        self.scheduler.release_unused(request)

    def _output(self, request: Request) -> RequestOutput:
        text = None
        if self.tokenizer is not None and request.finished:
            text = self.tokenizer.decode(request.output_token_ids, skip_special_tokens=True)
        if request.finished:
            self._requests.pop(request.request_id, None)
        return RequestOutput(
            request.request_id,
            request.token_ids[: request.num_prompt_tokens],
            request.output_token_ids,
            text,
            request.finish_reason,
            request.finished,
            request.metrics,
        )

    # ----- offline API -----
    def generate(
        self, prompts: Any, params: SamplingParams | list[SamplingParams] | None = None, use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order. All prompts are validated before any is queued."""
        items = normalize_prompts(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(items)
        if len(params_list) != len(items):
            raise ValueError(f"{len(params_list)} SamplingParams for {len(items)} prompts")
        for i, (prompt, p) in enumerate(zip(items, params_list)):
            ids = to_token_ids(prompt, self.tokenizer, self.adapter.vocab_size, where=f"prompts[{i}]")
            if len(ids) >= self.max_model_len:
                raise ValueError(f"prompts[{i}] has {len(ids)} tokens; needs < max_model_len={self.max_model_len}")
            if not isinstance(p, SamplingParams):
                raise TypeError(f"params[{i}] must be SamplingParams")
        ids = [self.add_request(prompt, p) for prompt, p in zip(items, params_list)]
        results: dict[str, RequestOutput] = {}
        bar = _progress(len(ids)) if use_tqdm else None
        while len(results) < len(ids):
            if not self.has_unfinished_requests():
                raise RuntimeError("engine stopped with unfinished generate() requests")
            for out in self.step():
                if out.finished and out.request_id in ids:
                    results[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [results[i] for i in ids]

    def close(self) -> None:
        close = getattr(self.controller, "close", None)
        if close is not None:
            close()

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks


def _progress(total: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="generate")
