"""LoopedSpecEngine: the user API and the step loop (schedule -> run -> commit -> feedback)."""

from __future__ import annotations

import functools
import itertools
import logging
import numbers
import operator
import os
import random
import time
from collections.abc import Iterable
from typing import Any

import torch
from tqdm import tqdm

from looped_spec.detokenizer import IncrementalDetokenizer
from looped_spec.engine import loop_decoding, step_decoding
from looped_spec.engine.chat import chat_prompt, conversations
from looped_spec.engine.config import EngineConfig
from looped_spec.engine.failures import StepFailures
from looped_spec.engine.inputs import (
    Prompt,
    bad_word_token_ids,
    check_bad_word_room,
    check_bias_tokens,
    check_encoded_vocabulary,
    check_filters_sample,
    check_prompt_room,
    check_top_count,
    check_vocabulary,
    end_tokens,
    load_tokenizer,
    naming,
    normalize_prompts,
    prompt_text,
    split_prompt,
    to_token_ids,
)
from looped_spec.engine.model_options import build_controller, model_len
from looped_spec.engine.outputs import request_output, time_tokens
from looped_spec.engine.prefix_cache import PrefixCache
from looped_spec.engine.resources import allocate_kv_cache, loop_pass_graphs, num_kv_blocks, step_graphs
from looped_spec.engine.scheduler import Scheduler
from looped_spec.engine.stats import EngineStats
from looped_spec.execution.host_memory import keep_freed_memory
from looped_spec.execution.kv_cache import KVCache
from looped_spec.execution.logprobs import token_logprobs
from looped_spec.execution.model_runner import ModelRunner
from looped_spec.execution.transfers import to_device
from looped_spec.loop_batching import LoopBatcher, LoopRounds
from looped_spec.models.adapter import ModelAdapter, load_adapter
from looped_spec.models.stage_check import check_stages
from looped_spec.reasoning import reasoning_parser
from looped_spec.request import Request, RequestOutput, TokenLogprob
from looped_spec.sampling_params import SamplingParams, sampling_params_argument
from looped_spec.speculative.round import SpeculativeRound
from looped_spec.structured_output import GrammarCompiler, StructuredOutputs
from looped_spec.token_bytes import TokenBytes

logger = logging.getLogger(__name__)


class LoopedSpecEngine:
    """Serve a looped model with continuous batching and (adaptive) self-speculative decoding.

    `model` is a checkpoint folder, a shipped model name, or a ModelAdapter; every other option is a field
    of `EngineConfig` (engine/config.py), given as a keyword or as `config=`. `speculation` is "off",
    "adaptive", a `SpeculativeConfig(k, d)`, or a "K,d" string. `early_exit` is how tokens that exit early
    (SamplingParams exit_threshold / exit_at_step, Ouro's config early_exit_threshold) run: "skip" (loops
    after the exit are not computed; their KV planes hold the exit loop's KV) or "select" (every loop runs
    and is cached; only the readout depth follows the exit). With speculation the target is the early-exit
    model: the draft applies the same exit rule, and a position that exits within the draft needs no
    verification (speculative/exit_round.py).
    """

    #: a request whose step fails this many times in a row while it runs alone finishes with "error"
    FAILURES_TO_BLAME = StepFailures.FAILURES_TO_BLAME

    def __init__(self, model: str | os.PathLike | ModelAdapter, config: EngineConfig | None = None, **options: Any):
        """`options` are `EngineConfig` fields (they override `config`'s); a wrong one raises ValueError naming it."""
        if not isinstance(model, (str, os.PathLike, ModelAdapter)):
            raise ValueError(
                f"LoopedSpecEngine: model={model!r}: must be a checkpoint folder, a shipped model name or a "
                f"ModelAdapter, got {type(model).__name__}"
            )
        self.config = config = EngineConfig.from_options(config, **options)
        if isinstance(model, ModelAdapter):
            loading = [f"{name}={value!r}" for name, value in
                       (("dtype", config.dtype), ("device", config.device), ("adapter_options", config.adapter_options))
                       if value not in ("auto", None, {})]  # fmt: skip
            if loading:
                raise ValueError(f"{', '.join(loading)}: apply when loading a checkpoint, not to a ModelAdapter "
                                 "instance (it is loaded already)")  # fmt: skip
            self.adapter = model
            self._owns_adapter = False  # the caller's: close() leaves its weights alone
        else:
            self._owns_adapter = True
            self.adapter = load_adapter(
                model, dtype=config.dtype, device=config.device, **(config.adapter_options or {})
            )
        check_stages(self.adapter)  # what the family declares holds for what its stages compute (stage_check.py)
        if torch.device(self.adapter.device).type == "cpu":
            keep_freed_memory()  # big per-step tensors reuse freed heap instead of page-faulting (host_memory.py)
        self.max_model_len = model_len(config, self.adapter)
        self.controller = build_controller(config, self.adapter)
        self.speculation = config.speculation
        self.max_batch_size = config.max_batch_size
        blocks = num_kv_blocks(self.adapter, self.max_model_len, config.max_batch_size, config.block_size,
                               config.num_kv_blocks, config.kv_cache_memory_gb)  # fmt: skip
        self.kv = allocate_kv_cache(self.adapter, blocks, config.block_size, config.num_kv_blocks,
                                    config.kv_cache_memory_gb)  # fmt: skip
        kv_bytes = self.kv.num_blocks * KVCache.bytes_per_block(
            self.adapter.kv_layout, config.block_size, self.adapter.dtype
        )
        logger.info(
            "engine: %s (%s, D=%d) on %s, %s; KV cache %d blocks x %d tokens (%.1f MiB); max_batch_size %d, "
            "max_model_len %d; controller %s",
            self.adapter.name,
            self.adapter.model_type,
            self.adapter.full_depth,
            self.adapter.device,
            str(self.adapter.dtype).removeprefix("torch."),
            self.kv.num_blocks,
            config.block_size,
            kv_bytes / 2**20,
            config.max_batch_size,
            self.max_model_len,
            type(self.controller).__name__,
        )
        prefix_cache = PrefixCache(self.kv, self.adapter.needs_token_seeds) if config.prefix_caching else None
        self.scheduler = Scheduler(self.kv, config.max_batch_size, config.max_num_batched_tokens, prefix_cache,
                                   config.scheduling_policy)  # fmt: skip
        graphs = None
        if config.batching == "step":
            graphs = step_graphs(self.adapter, self.kv, self.max_model_len, self.max_batch_size,
                                 self.controller.plan_shapes(), config.cuda_graphs)  # fmt: skip
        self.runner = ModelRunner(self.adapter, self.kv, config.early_exit, graphs, self.controller.readout_depths())
        # loop-level batching: decode steps are loop passes over the work in flight (loop_batching/); rounds are per
        # request there (K drafts with the first d loops, then one verification item), under the plan the controller
        # gave the pass in which they entered
        self.loop_batcher = self.loop_rounds = None
        if config.batching == "loop":
            pass_graphs = loop_pass_graphs(self.adapter, self.kv, self.runner.paged_kernel, self.max_model_len,
                                           self.max_batch_size, config.cuda_graphs)  # fmt: skip
            self.loop_batcher = LoopBatcher(self.runner, pass_graphs)
            exit_skips = config.early_exit == "skip"
            self.loop_rounds = LoopRounds(self.adapter.full_depth, exit_skips, self.runner.readout_depths)
        self.spec_round = SpeculativeRound(self.runner)
        self.tokenizer = load_tokenizer(self.adapter.path)
        # a token id's text in log-probability entries (vLLM's `decoded_token`), each decoded once
        self._token_text = None if self.tokenizer is None else functools.cache(TokenBytes(self.tokenizer).text)
        self._grammars = GrammarCompiler(self.tokenizer, self.adapter.vocab_size, self.eos_token_ids)
        # config.reasoning_parser: a request's grammar starts after the reasoning (looped_spec/reasoning.py)
        self.reasoning = None
        if config.reasoning_parser is not None:
            self.reasoning = reasoning_parser(config.reasoning_parser)
            try:
                self.reasoning.grammar_gate(self.tokenizer, self.adapter.vocab_size)
            except ValueError as exc:
                raise ValueError(f"reasoning_parser={config.reasoning_parser!r}: {exc}") from None
        self.stats = EngineStats()
        self._rng = random.Random(config.seed)
        self._ids = itertools.count()
        self._arrivals = itertools.count()  # admission order, for newest-first preemption
        self._requests: dict[str, Request] = {}  # live requests, and finished ones until their output is returned
        self._reports: dict[str, Request] = {}  # outputs owed to the caller (advanced, finished, aborted)
        self.failures = StepFailures()  # a step is a transaction (failures.py)
        self._closed = False

    def resolve_exit(self, params: SamplingParams) -> tuple[float | None, int | None]:
        """(exit_threshold, exit_at_step) a request with `params` runs with (None: no rule / up to D).

        Raises ValueError naming the field when this engine cannot run the request's early exit; the server
        asks it before a request starts (read-only).
        """
        adapter, depth = self.adapter, self.adapter.full_depth
        if params.exit_at_step is not None:
            if params.exit_at_step > depth:
                raise ValueError(f"exit_at_step={params.exit_at_step} exceeds the model's {depth} loops")
            return None, params.exit_at_step if params.exit_at_step < depth else None
        threshold = params.exit_threshold
        if threshold is not None and not adapter.has_exit_rule:
            raise ValueError(
                f"exit_threshold={threshold}: {adapter.model_type} has no exit signal; "
                "use exit_at_step for a fixed depth"
            )
        top = adapter.max_exit_threshold
        if threshold is not None and top is not None and threshold > top:
            raise ValueError(
                f"exit_threshold={threshold}: {adapter.model_type}'s exit rule reads a threshold of at most {top}"
            )
        if threshold is None:
            threshold = adapter.default_exit_threshold
        if threshold is not None and not adapter.exit_rule_can_fire(threshold):
            threshold = None
        return threshold, None

    # ----- requests -----
    def add_request(
        self, prompt: Prompt, params: SamplingParams | None = None, request_id: str | None = None,
        priority: int = 0,
    ) -> str:  # fmt: skip
        """Validate and queue one request; returns its id. Nothing is queued if validation fails. `prompt`: text,
        token ids, or vLLM's `{"prompt": text}` / `{"prompt_token_ids": ids}`, either with a `"cache_salt"` (with
        prefix caching, it shares cached blocks only with requests of the same salt). `priority` (with
        scheduling_policy="priority"): lower values are admitted first and preempted last."""
        self._check_open()
        rng_state = self._rng.getstate()
        try:
            request = self._new_request(prompt, params, request_id, priority=priority)
        except Exception:
            self._rng.setstate(rng_state)  # a rejected request leaves the engine as it was, seeds included
            raise
        self._queue(request)
        return request.request_id

    def check_grammar(self, spec: StructuredOutputs) -> None:
        """ValueError naming the field when `spec` does not compile for this model (as `add_request` would raise)."""
        self._grammars.compile(spec)

    def _new_request(
        self, prompt: Any, params: Any, request_id: str | None, where: str = "prompt", taken: set[str] = frozenset(),
        priority: Any = 0, priority_field: str = "priority", params_where: str | None = None,
    ) -> Request:  # fmt: skip
        """A validated Request, not yet queued. `taken`: ids claimed by requests about to be queued with it.
        `params_where`: what an error in `params` is named by (`sampling_params[2]`, one of a list), None: its field."""
        self.check_priority(priority, priority_field)
        params = params or SamplingParams()
        if not isinstance(params, SamplingParams):  # (generate checked its list's entries)
            # vLLM's LLMEngine.add_request(request_id, prompt, params) puts the id first: a text there lands here
            order = (" (add_request takes (prompt, params, request_id): vLLM's LLMEngine puts request_id first)"
                     if isinstance(params, str) else "")  # fmt: skip
            raise TypeError(f"params must be SamplingParams, got {type(params).__name__}{order}")
        _, cache_salt = split_prompt(prompt, where)  # a prompt dict's salt (and its keys checked)
        ids = to_token_ids(prompt, self.tokenizer, self.adapter.vocab_size, where=where)
        check_prompt_room(len(ids), self.max_model_len, where)
        if request_id is not None:
            request_id = str(request_id)
            if request_id in self._requests or request_id in taken:
                raise ValueError(f"request_id {request_id!r} is already in use")
        with naming(params_where):  # every error below is about params
            # the checkpoint's generation_config.json sampling defaults fill the fields the caller did not set
            defaults = self.adapter.generation.sampling_defaults()
            given = set(params.model_fields_set)
            unset = {key: value for key, value in defaults.items() if key not in given}
            if unset:
                params = params.model_copy(update=unset)
                # max_tokens from the file (model_copy validates nothing)
                if params.max_tokens is not None and params.min_tokens > params.max_tokens:
                    raise ValueError(f"min_tokens={params.min_tokens} is more than max_tokens={params.max_tokens}, the "
                                     "checkpoint's generation_config.json max_new_tokens: set max_tokens")  # fmt: skip
            check_filters_sample(params, given)
            check_vocabulary(params.stop_token_ids, self.adapter.vocab_size, "stop_token_ids")
            stops = set(params.stop_token_ids) | set(self.eos_token_ids)  # masked before min_tokens, ignore_eos or not
            if params.min_tokens and len(stops) >= self.adapter.vocab_size:
                raise ValueError(f"min_tokens={params.min_tokens}: every token of the vocabulary is a stop token (eos "
                                 "and stop_token_ids), so none may be sampled before min_tokens")  # fmt: skip
            check_bias_tokens(params.logit_bias, self.adapter.vocab_size)
            check_top_count(params.logprobs, self.adapter.vocab_size, "logprobs")
            check_top_count(params.prompt_logprobs, self.adapter.vocab_size, "prompt_logprobs")
            if params.allowed_token_ids is not None:
                check_vocabulary(params.allowed_token_ids, self.adapter.vocab_size, "allowed_token_ids")
                if params.min_tokens and set(params.allowed_token_ids) <= stops:
                    raise ValueError(f"allowed_token_ids: every one is a stop token (eos or stop_token_ids), so none "
                                     f"may be sampled before min_tokens={params.min_tokens}")  # fmt: skip
            vocab_size = self.adapter.vocab_size
            bad_words = bad_word_token_ids(params.bad_words, self.tokenizer, vocab_size) if params.bad_words else []
            if bad_words:
                check_bad_word_room(bad_words, params.allowed_token_ids, params.min_tokens, stops, vocab_size)
            if params.stop and self.tokenizer is None:
                raise ValueError("stop strings need the model's tokenizer files; use stop_token_ids instead")
            exit_threshold, exit_at_step = self.resolve_exit(params)
            seed = params.seed if params.seed is not None else self._rng.randrange(2**31)
            grammar = None
            if params.structured_outputs is not None:
                gate = params.reasoning_end_token_ids
                if gate is not None:
                    check_vocabulary(gate, self.adapter.vocab_size, "reasoning_end_token_ids")
                elif self.reasoning is not None:  # the grammar starts after the reasoning (looped_spec/reasoning.py)
                    gate = self.reasoning.grammar_gate(self.tokenizer, self.adapter.vocab_size, ids)
                grammar = self._grammars.compile(params.structured_outputs, gate=gate or ())
            detokenizer = None
            if self.tokenizer is not None:
                detokenizer = IncrementalDetokenizer(self.tokenizer, params.stop, params.skip_special_tokens,
                                                     params.include_stop_str_in_output, ids)  # fmt: skip
        if request_id is None:  # the next number no live request uses (a caller may have chosen "3" itself), drawn
            request_id = str(next(self._ids))  # once the request is valid: a refused one takes none
            while request_id in self._requests or request_id in taken:
                request_id = str(next(self._ids))
        text = prompt_text(prompt)
        request = Request(
            request_id, next(self._arrivals), ids, params, seed, self.eos_token_ids, self.max_model_len,
            detokenizer, text, grammar, bad_words,
        )  # fmt: skip
        request.exit_threshold, request.exit_at_step = exit_threshold, exit_at_step
        request.priority = priority
        request.cache_salt = cache_salt
        request.token_text = self._token_text
        if params.prompt_logprobs is not None:  # prompts run at full depth: the dense forward's logits are prefill's
            try:
                request.prompt_logprobs = self.score(ids, params.prompt_logprobs, seed)
            except (ValueError, TypeError) as exc:  # its arguments were checked above: model code raised it, a fault
                raise RuntimeError(f"the prompt_logprobs forward failed: {type(exc).__name__}: {exc}") from exc
        request.metrics.arrival_time = time.perf_counter()
        return request

    def check_priority(self, priority: Any, field: str = "priority") -> None:
        """ValueError (TypeError for a non-integer) naming `field` unless `priority` is one this engine schedules by:
        any integer under scheduling_policy="priority", only 0 under "fcfs" (vLLM refuses it likewise)."""
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise TypeError(f"{field} must be an integer, got {type(priority).__name__}")
        if priority and self.config.scheduling_policy != "priority":
            raise ValueError(f"{field}={priority}: requests are served first come, first served; a priority needs "
                             "scheduling_policy='priority' (--scheduling-policy priority)")  # fmt: skip

    def _queue(self, request: Request) -> None:
        self._requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop a request now, or each of several (as vLLM's `abort_request` takes them; all are checked before any
        stops); its output (finish_reason "abort") comes from the next `step()`. An id this engine does not hold
        (never added, or finished and reported) is a KeyError."""
        self._check_open()
        ids = [request_id] if isinstance(request_id, str) or not isinstance(request_id, Iterable) else list(request_id)
        requests = [self._requests.get(str(one)) for one in ids]
        unknown = [one for one, request in zip(ids, requests) if request is None]
        if unknown:
            raise KeyError(f"unknown request_id {unknown[0]!r}" if len(ids) == 1 else f"unknown request_ids {unknown}")
        for request in requests:
            if request.finished:
                continue
            self.scheduler.finish(request, "abort")
            self.stats.finished_reasons["abort"] += 1
            self._reports[request.request_id] = request
            if self.loop_batcher is not None:  # its work in flight holds the KV blocks it just gave back
                self.loop_batcher.drop(request.request_id)

    @property
    def eos_token_ids(self) -> list[int]:
        """The tokens that end a request as eos (unless `ignore_eos`): the model's and its tokenizer's (end_tokens)."""
        return end_tokens(self.adapter, self.tokenizer)

    def get_tokenizer(self) -> Any:
        """The model's tokenizer (`transformers`), None for a model without one; as vLLM's `get_tokenizer()`."""
        return self.tokenizer

    def request_ids(self) -> list[str]:
        """The ids of the requests the engine holds: waiting, running, or finished with their output not returned yet
        (the ids `abort` takes)."""
        return list(self._requests)

    def has_unfinished_requests(self) -> bool:
        """True while a request runs or waits, or a finished request's output has not been returned yet."""
        return self.scheduler.has_unfinished() or bool(self._reports)

    # ----- the step loop -----
    def step(self) -> list[RequestOutput]:
        """Run one prefill step or one decode round; outputs of requests that advanced or finished.

        A step is a transaction (docs/architecture.md, "Failure semantics"): if running it fails, every
        request is left as it was and the error is raised; the requests of that step then run one at a
        time until each has stepped once (on loop passes: until its token, round or prompt chunk is done), and a
        request whose step fails twice in a row by itself finishes with finish_reason "error". Outputs not yet
        returned (a failed step, an abort) come with a later step.
        """
        self._check_open()
        self._step_once()
        return self._take_outputs()

    def _step_once(self) -> None:
        """Schedule, run and commit one step: a loop pass (`batching="loop"`) or a prefill step or decode round."""
        suspect = self.failures.next_suspect()
        if self.loop_batcher is not None:
            loop_decoding.step(self, suspect)
        else:
            step_decoding.step(self, suspect)

    def exit_rule_reads_kv(self, request: Request) -> bool:
        """Whether the request's exit rule reads out through attention (it then decodes plainly: K = 0)."""
        return request.exit_threshold is not None and self.adapter.exit_rule_reads_kv

    def _finish_with_error(self, request: Request, exc: Exception) -> None:
        logger.warning("request %s failed by itself and is finished with an error: %r", request.request_id, exc)
        request.error = f"{type(exc).__name__}: {exc}"
        self.scheduler.finish(request, "error")
        self.stats.num_requests_failed += 1
        self._reports[request.request_id] = request
        if self.loop_batcher is not None:
            self.loop_batcher.drop(request.request_id)

    def _commit(self, requests: list[Request], tokens: list[list[int]], **counts: Any) -> None:
        """Hand the step's results to the scheduler's postprocess; from here on the outputs are owed."""
        if counts.get("exit_depths") is not None:  # depths are kept for the requests that exit early only
            counts["exit_depths"] = [ds if r.exits_early else [] for r, ds in zip(requests, counts["exit_depths"])]
        appended, failed = self.scheduler.postprocess(requests, tokens, **counts)
        for request, exc in failed:  # its own commit failed (its tokenizer): it alone finishes, with the error
            self._finish_with_error(request, exc)
        exit_depths = counts.get("exit_depths")
        if exit_depths is not None:
            # a first token is read out from the prompt's last position, whose loops all ran (prompts: full depth)
            skipped = self.runner.exit_mode == "skip" and "chunk_lens" not in counts
            depths = [d for ds, n in zip(exit_depths, appended) for d in ds[:n]]
            self.stats.count_exits(depths, self.adapter.full_depth, skipped=skipped)
        now = time.perf_counter()
        for request, n in zip(requests, appended):
            if n:
                time_tokens(self.stats, request, n, now)
            if n or request.finished:
                self._reports[request.request_id] = request
            if request.finished and request.finish_reason != "error":
                self.stats.num_requests_finished += 1
                self.stats.finished_reasons[request.finish_reason] += 1
        self.stats.num_generation_tokens += sum(appended)
        if "num_proposed" in counts:  # a decode round's commit
            self.stats.num_round_tokens += sum(appended)

    def _take_outputs(self, only: set[str] | None = None, finished_only: bool = False) -> list[RequestOutput]:
        """Outputs owed to the caller (all, or those in `only`); each finished request is returned once.
        `finished_only`: the others' are dropped unbuilt (`generate` returns each output once, whole)."""
        outputs = []
        for request_id in [i for i in self._reports if only is None or i in only]:
            request = self._reports.pop(request_id)
            if request.finished:
                self._requests.pop(request_id, None)
            elif finished_only:
                continue
            outputs.append(request_output(request))
        return outputs

    # ----- offline API -----
    def get_default_sampling_params(self) -> SamplingParams:
        """vLLM's `LLM.get_default_sampling_params`: the checkpoint's generation_config.json sampling defaults (what
        a request leaves unset gets) as SamplingParams; `SamplingParams()` without the file. SamplingParams is frozen:
        `model_copy(update={...})` changes a field (vLLM's is changed in place)."""
        return SamplingParams(**self.adapter.generation.sampling_defaults())

    def generate(
        self, prompts: Any, sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False, priority: list[int] | None = None, *,
        params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:  # fmt: skip
        """Run prompts to completion; outputs in prompt order, each once and whole (its `new_token_ids` and
        `new_text` are all of it). All prompts are validated before any is queued.
        `prompts`: a prompt or a list of them, each as `add_request` takes it (vLLM's prompt dicts included).
        `sampling_params`: one for every prompt, or one per prompt (`params=`: its older name).
        `priority`: one per prompt (scheduling_policy="priority"; lower values first), as vLLM's `LLM.generate`.

        Requests added with `add_request` keep running alongside; their outputs stay for `step()`. If a step
        fails, this call's requests are aborted (and forgotten) and the error is raised.
        """
        self._check_open()
        params = sampling_params_argument(sampling_params, params)
        items = normalize_prompts(prompts)
        params_list = params if isinstance(params, list) else [params or SamplingParams()] * len(items)
        if len(params_list) != len(items):
            raise ValueError(f"sampling_params: {len(params_list)} SamplingParams for {len(items)} prompts")
        for i, p in enumerate(params_list):
            if not isinstance(p, SamplingParams):
                raise TypeError(f"sampling_params[{i}] must be SamplingParams, got {type(p).__name__}")
        if priority is not None and (not isinstance(priority, (list, tuple)) or len(priority) != len(items)):
            given = f"{len(priority)} entries" if isinstance(priority, (list, tuple)) else type(priority).__name__
            raise ValueError(f"priority: one integer per prompt ({len(items)}), got {given}")
        priorities = list(priority) if priority is not None else [0] * len(items)
        rng_state = self._rng.getstate()
        requests: list[Request] = []
        try:
            for i, (prompt, p, rank) in enumerate(zip(items, params_list, priorities)):
                taken = {r.request_id for r in requests}
                requests.append(self._new_request(
                    prompt, p, None, where=f"prompts[{i}]", taken=taken, priority=rank, priority_field=f"priority[{i}]",
                    params_where=f"sampling_params[{i}]" if isinstance(params, list) else None,
                ))  # fmt: skip
        except BaseException:
            self._rng.setstate(rng_state)  # a rejected call leaves the engine as it was, seeds included
            raise
        for request in requests:
            self._queue(request)
        ids = [r.request_id for r in requests]
        mine = set(ids)
        results: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(ids), desc="generate", disable=not use_tqdm)
        try:
            while len(results) < len(ids):
                if not (self.scheduler.has_unfinished() or mine & self._reports.keys()):
                    raise RuntimeError("engine stopped with unfinished generate() requests")
                self._step_once()
                for out in self._take_outputs(only=mine, finished_only=True):
                    results[out.request_id] = out
                    bar.update(1)
        except BaseException:
            self._forget(requests)
            raise
        finally:
            bar.close()
        return [results[i] for i in ids]

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = False,
        *,
        params: SamplingParams | list[SamplingParams] | None = None,
        chat_template: str | None = None,
        chat_template_content_format: str = "auto",
        chat_template_kwargs: dict[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: list[dict] | None = None,
        mm_processor_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """`generate` for chat, as vLLM's `LLM.chat`: each conversation (`messages`: one, a list of
        {"role", "content"} dicts, or a list of them) rendered by the tokenizer's chat template (or `chat_template`,
        the template's text) with `chat_template_kwargs` as template variables and `tools` as its `tools`;
        `continue_final_message` (with `add_generation_prompt=False`) continues the last message instead of opening a
        turn. The reply ends at the tokenizer's end-of-turn token (its eos) as well as the model's, unless
        `ignore_eos`. Every conversation is rendered before any is queued (`params=`: `sampling_params`' older
        name). A message's text parts reach the template as one string (vLLM's "string" content format, which
        `chat_template_content_format` "auto" stands for here); `mm_processor_kwargs` is taken only empty (text-only
        models)."""
        if chat_template_content_format not in ("auto", "string"):
            raise ValueError(f"chat_template_content_format={chat_template_content_format!r}: only 'auto' or "
                             "'string' (a message's text parts reach the template as one string)")  # fmt: skip
        if mm_processor_kwargs:  # None or {} asks for nothing, as in a prompt dict
            raise ValueError("mm_processor_kwargs: not supported, the models served here take text only")
        params = sampling_params_argument(sampling_params, params)
        items = conversations(messages)
        rendered = [
            chat_prompt(
                self.tokenizer,
                conversation,
                f"messages[{i}]" if len(items) > 1 else "messages",
                chat_template=chat_template,
                template_kwargs=chat_template_kwargs,
                tools=tools,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
            )  # fmt: skip
            for i, conversation in enumerate(items)
        ]
        prompts = [ids for _, ids in rendered]
        for i, ids in enumerate(prompts):  # named as the conversation, not as an index into ids the caller never saw
            where = f"messages[{i}]" if len(items) > 1 else "messages"
            check_encoded_vocabulary(ids, self.adapter.vocab_size, where)
            if not ids:
                raise ValueError(f"{where}: the chat template renders an empty prompt")
            check_prompt_room(len(ids), self.max_model_len, f"{where}: its rendered prompt")
        if isinstance(params, list) and len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} SamplingParams for {len(prompts)} conversations")
        outputs = self.generate(prompts, params, use_tqdm=use_tqdm)  # one for all keeps its errors unnumbered
        for output, (text, _) in zip(outputs, rendered):
            output.prompt = text  # the rendered conversation, as vLLM's LLM.chat reports it
        return outputs

    def _forget(self, requests: list[Request]) -> None:
        """Abort `requests` and drop them and their pending outputs (their caller got an exception instead)."""
        for request in requests:
            if not request.finished:
                self.scheduler.finish(request, "abort")
            if self.loop_batcher is not None:
                self.loop_batcher.drop(request.request_id)
            self.failures.drop(request)
            self._reports.pop(request.request_id, None)
            self._requests.pop(request.request_id, None)

    @torch.inference_mode()
    def score(self, token_ids: list[int], top_n: int = 0, seed: int = 0) -> list[TokenLogprob | None]:
        """The log-probability of every token given the ones before it (the first: None) and the `top_n` most likely
        tokens at each position, from the model's full-depth logits before temperature: a cache-free forward of the
        whole sequence (the reference path; the engine's decode logits equal it, dense == incremental), whose logits
        are read out `max_num_batched_tokens` positions at a time. `seed` is the request seed a family with per-token
        random draws (Huginn's initial state) uses. It scores a prompt, and the tokens of a finished generation that
        ran at full depth (plain or speculative: the target's logits)."""
        self._check_open()
        ids, top_n, seed = self._score_arguments(token_ids, top_n, seed)
        if not ids:
            return []
        ids = to_device(ids, self.adapter.device)
        # position t scores token t + 1; logits max_num_batched_tokens positions at a time, as a prefill step's, not
        # [T, V] at once (a long prompt's on a large vocabulary would not fit beside the KV cache)
        entries: list[TokenLogprob | None] = [None]
        for logits in self.adapter.dense_logit_chunks(ids, self.config.max_num_batched_tokens, seeds=[seed]):
            targets = ids[len(entries) : len(entries) + len(logits)]
            rows = len(targets)
            entries += token_logprobs(logits[:rows], targets, [top_n] * rows, [self._token_text] * rows)
            del logits  # before the next chunk is projected: one chunk's logits at a time
        return entries

    def check_score(self, token_ids: list[int], top_n: int = 0, seed: int = 0) -> None:
        """The ValueError / TypeError `score` raises for these arguments, naming the one at fault (reads the engine's
        config only: safe beside a thread stepping it). What `score` raises past it is the model's."""
        self._score_arguments(token_ids, top_n, seed)

    def _score_arguments(self, token_ids: Any, top_n: Any, seed: Any) -> tuple[list[int], int, int]:
        if not isinstance(token_ids, (list, tuple)):  # text, a prompt dict or an array is not read as token ids
            raise TypeError(f"token_ids must be a list of token ids (score tokenized text); got "
                            f"{type(token_ids).__name__}")  # fmt: skip
        ids = to_token_ids(token_ids, None, self.adapter.vocab_size, where="token_ids") if token_ids else []
        if len(ids) > self.max_model_len:
            raise ValueError(f"token_ids: {len(ids)} tokens; at most max_model_len={self.max_model_len}")
        return ids, _integer(top_n, "top_n", 0, self.adapter.vocab_size), _integer(seed, "seed", 0, 2**63 - 1)

    def close(self) -> None:
        """Release what the engine holds: its unfinished requests (dropped: their outputs are not returned), the KV
        cache, the CUDA graphs, the controller's trace and, when the engine loaded them, the weights. Safe to call
        twice; afterwards the engine refuses work with a RuntimeError. `with LoopedSpecEngine(...) as engine:` closes
        it at the end of the block."""
        if self._closed:
            return
        self._closed = True
        self.controller.close()
        for queue in (self.scheduler.waiting, self.scheduler.running):
            queue.clear()
        self._requests.clear()
        self._reports.clear()
        self.failures.clear()
        self.kv.release()
        self.runner = self.spec_round = self.loop_batcher = None  # they hold the adapter (and the graphs)
        if self._owns_adapter:
            self.adapter = None

    @property
    def closed(self) -> bool:
        """Whether `close()` ran (the engine then refuses work)."""
        return self._closed

    def __enter__(self) -> LoopedSpecEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("this LoopedSpecEngine is closed (close() released its KV cache and weights)")

    @property
    def num_free_blocks(self) -> int:
        return self.kv.num_free_blocks


def _integer(value: Any, name: str, low: int, high: int) -> int:
    """`value` as an int in [low, high] (any integer type, numpy's too; never a bool), else a ValueError naming it."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool) and low <= value <= high:
        return operator.index(value)
    raise ValueError(f"{name}={value!r} must be an integer in [{low}, {high}]")
