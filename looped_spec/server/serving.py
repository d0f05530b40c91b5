"""OpenAIServing: API requests -> engine requests, engine outputs -> API responses and SSE events."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import AsyncIterator
from contextlib import aclosing

from fastapi import Request
from pydantic import ValidationError

from looped_spec.engine import inputs
from looped_spec.engine.async_engine import AsyncLoopedSpecEngine, EngineDeadError, EngineFaultError, QueueFullError
from looped_spec.engine.inputs import load_tokenizer
from looped_spec.reasoning import reasoning_parser as reasoning_parser_named
from looped_spec.request import RequestOutput
from looped_spec.sampling_params import SamplingParams
from looped_spec.server.chat import GenerationDefaults
from looped_spec.server.chat_template import ChatTemplateConfig
from looped_spec.server.errors import APIError, error_body, validation_message
from looped_spec.server.metrics import ServerMetrics
from looped_spec.server.protocol import (
    ChatLogprobs,
    ChatMessage,
    ChatTokenLogprob,
    CompletionLogprobs,
    CompletionRequest,
    ModelCard,
    PromptTokensDetails,
    SamplingFields,
    TopLogprob,
    UsageInfo,
)
from looped_spec.server.tools import ToolCallingConfig, ToolPlan
from looped_spec.token_bytes import TextOffsets, TokenBytes

MAX_STOP_STRINGS = 16
MAX_BAD_WORDS = 128  # vLLM's limit (its GPU model runner's)
MAX_PROMPTS = 64  # prompts in one completions request (each with `n` choices)
RETRY_AFTER_S = "1"


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(
        self,
        engine: AsyncLoopedSpecEngine,
        model_name: str,
        tool_calling: ToolCallingConfig | None = None,
        chat_template: ChatTemplateConfig | None = None,
        reasoning_parser: str | None = None,
        return_tokens_as_token_ids: bool = False,
    ) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tokens_as_ids = return_tokens_as_token_ids  # log-probabilities' tokens as "token_id:<id>" by default
        # chat replies' reasoning taken apart from their content (looped_spec/reasoning.py); None: replies as generated
        self.reasoning = reasoning_parser_named(reasoning_parser) if reasoning_parser is not None else None
        self.tool_calling = tool_calling if tool_calling is not None else ToolCallingConfig()
        self.chat_template = chat_template if chat_template is not None else ChatTemplateConfig()
        core = engine.engine
        # the engine's tokenizer belongs to its worker thread; the front tokenises with its own copy
        self.tokenizer = load_tokenizer(core.adapter.path)
        self.token_bytes = TokenBytes(self.tokenizer)  # log-probabilities show tokens by their own bytes
        self.vocab_size = core.adapter.vocab_size
        self.max_model_len = core.max_model_len
        self.defaults = GenerationDefaults.from_config(core.adapter.generation)
        # the engine's eos tokens (the tokenizer's among them, where it is in the vocabulary): what the engine stops on
        self.eos_token_ids = core.eos_token_ids
        self.metrics = ServerMetrics(core, model_name)

    def model_card(self) -> ModelCard:
        """The served model as /v1/models lists it (`root`: the checkpoint folder, or the id of a model given as an
        adapter object without one)."""
        path = self.engine.engine.adapter.path
        return ModelCard(id=self.model_name, root=self.model_name if path is None else str(path),
                         max_model_len=self.max_model_len)  # fmt: skip

    # ----- request -> engine -----
    def check_model(self, model: str | None) -> None:
        """A model this server serves (None: left out, the one it serves)."""
        if model is not None and model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model")

    def check_request(self, body: SamplingFields) -> None:
        """What every generation request must get right before anything else: the model, stream options only with a
        stream (they would otherwise be silently ignored), and a priority the engine schedules by."""
        self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options: only with stream: true", "stream_options")
        options = body.stream_options
        if options is not None and options.continuous_usage_stats and options.include_usage is False:
            # vLLM sends no usage at all then; asking for it in every chunk and in none is refused rather than ignored
            field = "stream_options.continuous_usage_stats"
            raise APIError(400, f"{field}: true with include_usage: false would send no usage; leave include_usage out "
                           "or set it true", field)  # fmt: skip
        try:
            self.engine.engine.check_priority(body.priority)
        except ValueError as exc:
            raise APIError(400, str(exc), "priority") from exc

    def check_choices(self, num_choices: int, n: int) -> None:
        """400 for more choices (prompts × n) than the server ever runs or queues at once."""
        if num_choices > self.engine.max_in_flight:
            param = "n" if n > 1 else "prompt"
            raise APIError(400, f"{param}: {num_choices} choices (prompts × n) exceed the {self.engine.max_in_flight} "
                           "requests this server runs or queues at once", param)  # fmt: skip

    def prompt_lists(
        self, prompt, param: str = "prompt", scored_only: bool = False, add_special_tokens: bool = True
    ) -> list[list[int]]:
        """Token ids of each prompt of a completions request (a string, token ids, or a list of either)."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > MAX_PROMPTS:
                raise APIError(400, f"{param}: at most {MAX_PROMPTS} prompts per request (got {len(prompt)})", param)
            return [self.prompt_ids(p, f"{param}[{i}]", scored_only, add_special_tokens) for i, p in enumerate(prompt)]
        return [self.prompt_ids(prompt, param, scored_only, add_special_tokens)]

    def prompt_ids(
        self, prompt, param: str = "prompt", scored_only: bool = False, add_special_tokens: bool = True
    ) -> list[int]:
        """A prompt's token ids; `scored_only`: it is scored, not generated from, so it may fill max_model_len.
        `add_special_tokens`: the tokenizer's own (a BOS) around a text, as the offline engine encodes prompts; a
        rendered chat template already holds them."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, f"{param}: the model has no tokenizer; send token ids", param)
            check_text(prompt, param)
            ids = self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
            bad_request(inputs.check_encoded_vocabulary, ids, self.vocab_size, param)
        else:
            ids = list(prompt)
            bad_request(inputs.check_vocabulary, ids, self.vocab_size, param)
        if not ids:
            raise APIError(400, f"{param} is empty", param)
        if len(ids) > self.max_model_len or (len(ids) == self.max_model_len and not scored_only):
            limit = "at most" if scored_only else "fewer than"
            raise APIError(400, f"{param}: {len(ids)} tokens; must be {limit} max_model_len={self.max_model_len}",
                           param)  # fmt: skip
        return ids

    def completion_tokens(self, body: CompletionRequest) -> int | None:
        """A completion's max_tokens: the request's, else OpenAI's 16 within generation_config.json's
        max_new_tokens (vLLM's reading). A null max_tokens is an unset one (OpenAI's 16), where vLLM takes it for what
        the context leaves."""
        if "max_tokens" in body.model_fields_set or self.defaults.max_tokens is None:
            return body.max_tokens
        return min(body.max_tokens, self.defaults.max_tokens)

    def sampling_params(
        self,
        body: SamplingFields,
        num_prompt_tokens: int,
        max_tokens: int | None,
        choice: int = 0,
        seed: int | None = None,
        logprobs: int | None = None,
        scored_only: bool = False,
        reasoning_end: list[int] | None = None,
        max_tokens_field: str = "max_tokens",
    ) -> SamplingParams:
        """The engine's parameters of one choice; with `seed` s, choice j of a request draws with seed s + j modulo
        2**63 (so `n` choices are independent, and reproducible; a negative seed, which OpenAI's schema allows, too).
        `scored_only`: the prompt is scored, nothing generated (the parameters carry only what the scores depend on:
        the seed; scores are read at full depth, so the early-exit fields are refused). `reasoning_end`: where the
        grammar starts (`check_reasoning`).
        `max_tokens_field`: the field the client set `max_tokens` with (chat's `max_completion_tokens`), named in its
        errors."""
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:  # what the context leaves, within generation_config.json's max_new_tokens
            max_tokens = room if self.defaults.max_tokens is None else min(room, self.defaults.max_tokens)
        elif max_tokens > room and not scored_only:
            raise APIError(400, f"{max_tokens_field}: {max_tokens} + {num_prompt_tokens} prompt tokens exceeds "
                           f"max_model_len={self.max_model_len}", max_tokens_field)  # fmt: skip
        if body.structured_outputs is not None and body.response_format is not None:
            if body.response_format.type != "text":
                raise APIError(400, "structured_outputs: give a grammar in structured_outputs or response_format, not "
                               "both", "structured_outputs")  # fmt: skip
        most = 0 if scored_only else max_tokens  # scoring a prompt generates nothing
        if body.min_tokens > most:
            raise APIError(400, f"min_tokens: {body.min_tokens} is more than the {most} tokens the request may "
                           "generate", "min_tokens")  # fmt: skip
        if body.allowed_token_ids is not None:
            if scored_only:
                raise APIError(400, "allowed_token_ids: scoring a prompt (max_tokens 0) generates nothing to restrict",
                               "allowed_token_ids")  # fmt: skip
            bad_request(inputs.check_vocabulary, body.allowed_token_ids, self.vocab_size, "allowed_token_ids")
        words = self.check_bad_words(body.bad_words, scored_only) if body.bad_words else None
        stop = body.stop_list()
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings", "stop")
        if stop and self.tokenizer is None:
            raise APIError(400, "stop: the model has no tokenizer to find stop strings in; use stop_token_ids", "stop")
        for i, text in enumerate(stop):
            check_text(text, f"stop[{i}]" if isinstance(body.stop, list) else "stop")
        stop_token_ids = list(body.stop_token_ids or [])
        bad_request(inputs.check_vocabulary, stop_token_ids, self.vocab_size, "stop_token_ids")
        bad_request(inputs.check_bias_tokens, body.token_bias(), self.vocab_size, "logit_bias")
        # before echo scores the prompt with it (a model of fewer than 20 tokens): chat's count is top_logprobs
        top_field = "top_logprobs" if hasattr(body, "top_logprobs") else "logprobs"
        bad_request(inputs.check_top_count, logprobs, self.vocab_size, top_field)
        if words is not None:  # one-token words that leave nothing to generate, as the engine would refuse them
            stops = set(stop_token_ids) | (set() if body.ignore_eos else set(self.eos_token_ids))
            try:
                inputs.check_bad_word_room(words, body.allowed_token_ids, body.min_tokens, stops,
                                           self.vocab_size)  # fmt: skip
            except ValueError as exc:
                raise APIError(400, str(exc), "bad_words") from None
        for field in ("exit_threshold", "exit_at_step"):
            if scored_only and getattr(body, field) is not None:  # else taken and ignored: scores are full depth
                raise APIError(400, f"{field}: scoring a prompt (max_tokens 0) reads every position at full depth; "
                               "early exit applies to generated tokens", field)  # fmt: skip
        if body.exit_threshold is not None and body.exit_at_step is not None:
            raise APIError(400, "exit_at_step: set at most one of exit_threshold (each token chooses its depth) and "
                           "exit_at_step (a fixed depth)", "exit_at_step")  # fmt: skip
        d = self.defaults
        seed = body.seed if seed is None else seed
        try:
            params = SamplingParams(
                max_tokens=max_tokens,
                min_tokens=body.min_tokens,  # 0 when scored only (refused above otherwise)
                temperature=d.temperature if body.temperature is None else body.temperature,
                top_p=d.top_p if body.top_p is None else body.top_p,
                top_k=d.top_k if body.top_k is None else body.top_k,
                min_p=d.min_p if body.min_p is None else body.min_p,
                logit_bias=body.token_bias(),
                presence_penalty=body.presence_penalty or 0.0,
                frequency_penalty=body.frequency_penalty or 0.0,
                repetition_penalty=d.repetition_penalty if body.repetition_penalty is None else body.repetition_penalty,
                seed=None if seed is None else (seed + choice) % 2**63,
                stop=body.stop if isinstance(body.stop, str) else stop,  # a string named as given in errors
                include_stop_str_in_output=body.include_stop_str_in_output,
                skip_special_tokens=body.skip_special_tokens,
                structured_outputs=body.grammar(),  # None when scored only (`check_grammar` refuses one)
                reasoning_end_token_ids=reasoning_end,
                stop_token_ids=stop_token_ids,
                ignore_eos=body.ignore_eos,
                allowed_token_ids=body.allowed_token_ids,
                bad_words=body.bad_words,
                exit_threshold=body.exit_threshold,
                exit_at_step=body.exit_at_step,
                logprobs=logprobs,
            )
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise APIError(400, message, param) from exc
        self.check_exit(params)
        return params

    def check_bad_words(self, words: list[str], scored_only: bool) -> list[list[int]]:
        """A 400 naming bad_words where the engine would refuse them (no tokenizer, an empty word, one encoding
        outside the vocabulary), before the request starts: encoded with this front's tokenizer, as the engine's (the
        token sequences are returned)."""
        if scored_only:
            raise APIError(400, "bad_words: scoring a prompt (max_tokens 0) generates nothing to restrict", "bad_words")
        if len(words) > MAX_BAD_WORDS:
            raise APIError(400, f"bad_words: at most {MAX_BAD_WORDS} words", "bad_words")
        for i, word in enumerate(words):
            if not word.lstrip():
                raise APIError(400, f"bad_words[{i}] = {word!r} is empty" + (" but for whitespace" if word else ""),
                               "bad_words")  # fmt: skip
        try:
            return inputs.bad_word_token_ids(words, self.tokenizer, self.vocab_size, "bad_words")
        except ValueError as exc:
            raise APIError(400, str(exc), "bad_words") from None

    async def check_grammar(self, body: SamplingFields, scored_only: bool = False) -> None:
        """The request's grammar, compiled once off the event loop (a large schema takes tenths of a second): a 400
        naming the field when it does not compile, the model has no tokenizer, or the request only scores its prompt
        (nothing generated for a grammar to shape). The engine's compiler keeps it, so the request's choices copy it."""
        spec = body.grammar()
        if spec is None:
            return
        field = f"structured_outputs.{spec.kind}"
        if body.structured_outputs is None:
            field = "response_format.json_schema.schema" if spec.kind == "json" else "response_format"
        if scored_only:
            raise APIError(400, f"{field}: max_tokens 0 generates nothing for a grammar to shape", field)
        try:
            await asyncio.to_thread(self.engine.engine.check_grammar, spec)
        except ValueError as exc:
            raise APIError(400, f"{field}: {str(exc).split(': ', 1)[-1]}", field) from exc

    def check_masks_beside_grammar(self, body: SamplingFields, plan: ToolPlan | None = None) -> None:
        """bad_words and allowed_token_ids are refused beside a grammar (SamplingParams): a 400 naming the field the
        client sent, and the grammar's (structured_outputs, response_format, or a forced call's tool_choice)."""
        grammar = grammar_field(body, plan)
        if grammar is None:
            return
        if grammar == "tool_choice":
            grammar = f"tool_choice {'required' if plan.mode == 'required' else 'naming a function'} (a grammar)"
        if body.bad_words:
            raise APIError(400, f"bad_words: not with {grammar}: the grammar may leave only a bad word's token to "
                           "take; fold the words into the grammar", "bad_words")  # fmt: skip
        if body.allowed_token_ids is not None:
            raise APIError(400, f"allowed_token_ids: not with {grammar}: the grammar already decides which tokens may "
                           "come", "allowed_token_ids")  # fmt: skip

    def check_reasoning(self, body: SamplingFields, plan: ToolPlan, prompt: list[int]) -> list[int] | None:
        """With a reasoning parser, the token ids a chat request's grammar (structured outputs, response_format, a
        forced tool call) starts after: `</think>` as the model's tokenizer encodes it (under qwen3, [] when the prompt
        itself closed the reasoning), so the grammar shapes the content, not the reasoning (vLLM's rule,
        looped_spec/reasoning.py `grammar_gate`). None without a parser or a grammar; a 400 naming the grammar's field
        when `</think>` cannot be encoded."""
        field = grammar_field(body, plan)
        if self.reasoning is None or field is None:
            return None
        try:
            return self.reasoning.grammar_gate(self.tokenizer, self.vocab_size, prompt)
        except ValueError as exc:
            raise APIError(400, f"{field}: with --reasoning-parser {self.reasoning.name} a grammar starts after the "
                           f"reasoning, but {exc}", field) from exc  # fmt: skip

    async def check_tool_grammar(self, plan: ToolPlan) -> None:
        """A forced tool call's grammar, compiled once off the event loop as `check_grammar` does: a 400 naming the
        tool whose parameters schema does not compile (for "required", the first tool whose schema fails alone)."""
        if plan.grammar is None:
            return
        try:
            await asyncio.to_thread(self.engine.engine.check_grammar, plan.grammar)
        except ValueError as exc:
            field, error = plan.grammar_field, exc
            if plan.mode == "required":
                for tool_field, grammar in plan.each_tool_grammar():
                    try:
                        await asyncio.to_thread(self.engine.engine.check_grammar, grammar)
                    except ValueError as tool_error:
                        field, error = tool_field, tool_error
                        break
            raise APIError(400, f"{field}: {str(error).split(': ', 1)[-1]}", field) from exc

    def check_exit(self, params: SamplingParams) -> None:
        """Early exit the engine cannot run (speculation on, a depth past D, no exit signal): 400 before the
        request starts, so a stream never opens for it. The engine's rule, asked from this thread (read-only)."""
        field = "exit_threshold" if params.exit_threshold is not None else "exit_at_step"
        if getattr(params, field) is None:
            return
        try:
            self.engine.engine.resolve_exit(params)
        except ValueError as exc:
            message = str(exc) if str(exc).startswith(field) else f"{field}: {exc}"
            raise APIError(400, message, field) from exc

    def start_all(
        self, prompts: list[list[int]], params: list[SamplingParams], priority: int = 0, cache_salt: str | None = None
    ) -> list[AsyncIterator[RequestOutput]]:
        """Admit every choice of an API request together, or none (429 / 503 before any response starts; 400 for more
        choices than the server ever admits at once). `cache_salt`: every choice's, as vLLM's TokensPrompt carries
        it."""
        streams = []
        try:
            for ids, choice_params in zip(prompts, params):
                prompt = ids if cache_salt is None else {"prompt_token_ids": ids, "cache_salt": cache_salt}
                streams.append(self.engine.add_request(prompt, choice_params, priority=priority))
        except (QueueFullError, EngineDeadError) as exc:
            for stream in streams:
                stream.abort()
            if isinstance(exc, QueueFullError):
                raise APIError(429, f"server busy: {exc}; retry later", headers={"Retry-After": RETRY_AFTER_S}) from exc
            raise APIError(503, str(exc), headers={"Retry-After": RETRY_AFTER_S}) from exc
        arrival = time.perf_counter()
        return [self.metrics.timed(aiter(stream), arrival) for stream in streams]

    # ----- log-probabilities (scored by the engine's reference forward: LoopedSpecEngine.score) -----
    def scoring_seed(self, body: SamplingFields, wanted: bool) -> int | None:
        """The seed the choices run with when their tokens are scored afterwards: the request's, else one drawn here
        (a family with per-token random draws scores with the seed it generated with)."""
        if not wanted or body.seed is not None:
            return body.seed
        return random.randrange(2**31)

    async def score(self, token_ids: list[int], top_n: int, seed: int) -> list:
        try:
            return await self.engine.score(token_ids, top_n, seed)
        except QueueFullError as exc:
            raise APIError(429, f"server busy: {exc}; retry later", headers={"Retry-After": RETRY_AFTER_S}) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), headers={"Retry-After": RETRY_AFTER_S}) from exc
        except EngineFaultError as exc:  # the model failed on this score (the worker goes on)
            raise APIError(500, str(exc)) from exc

    def tokens_shown_as_ids(self, body: SamplingFields) -> bool:
        """Whether the request's log-probabilities show tokens as "token_id:<id>" (vLLM's return_tokens_as_token_ids,
        else the server's default); a 400 when the request asks for it without log-probabilities (it would do
        nothing)."""
        if body.return_tokens_as_token_ids is None:
            return self.tokens_as_ids
        logprobs = getattr(body, "logprobs", None)  # completions: a count (0 included), chat: a switch
        if body.return_tokens_as_token_ids and (logprobs is None or logprobs is False):
            raise APIError(400, "return_tokens_as_token_ids: needs logprobs (it shows the log-probabilities' tokens)",
                           "return_tokens_as_token_ids")  # fmt: skip
        return body.return_tokens_as_token_ids

    def token_name(self, token: int, as_id: bool, raw: bytes | None = None) -> str:
        """How log-probabilities show a token: "token_id:<id>" (exact, whatever its bytes), or its text (`raw`: its
        bytes where they differ from its own, the first of an echoed prompt)."""
        return f"token_id:{token}" if as_id else self.token_bytes.text(token, raw)

    def completion_logprobs(
        self, token_ids: list[int], entries: list, offsets: TextOffsets | None = None, as_ids: bool = False,
        starts_text: bool = False,
    ) -> CompletionLogprobs:  # fmt: skip
        """OpenAI's completions shape for `token_ids` with their scores (None: a first prompt token, unscored); text
        offsets from `offsets` (a choice's, carried across its stream chunks; None: from the start); `as_ids`: tokens
        shown as "token_id:<id>"; `starts_text`: the first token begins the choice's text (an echoed prompt, decoded
        whole), which a SentencePiece decoder strips of its first space."""
        offsets = offsets if offsets is not None else TextOffsets()
        out = CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for i, (token, entry) in enumerate(zip(token_ids, entries)):
            raw = self.token_bytes.raw_at_start(token) if starts_text and i == 0 else self.token_bytes.raw(token)
            out.tokens.append(self.token_name(token, as_ids, raw))
            out.token_logprobs.append(None if entry is None else entry.logprob)
            if entry is None:
                out.top_logprobs.append(None)
            else:  # the N most likely and the token itself, as OpenAI and vLLM give them (up to N + 1 entries)
                top = {self.token_name(t, as_ids): v for t, v in entry.top}
                top.setdefault(self.token_name(token, as_ids), entry.logprob)
                out.top_logprobs.append(top)
            out.text_offset.append(offsets.advance(raw))
        return out

    def chat_logprobs(self, entries: list, as_ids: bool = False) -> ChatLogprobs:
        def top(token: int, value: float) -> TopLogprob:
            return TopLogprob(
                token=self.token_name(token, as_ids), logprob=value, bytes=list(self.token_bytes.raw(token))
            )

        content = []
        for entry in entries:
            head = top(entry.token, entry.logprob)
            content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=[top(t, v) for t, v in entry.top]))
        return ChatLogprobs(content=content)

    # ----- engine -> response -----
    @staticmethod
    def new_logprobs(out: RequestOutput) -> list:
        """The entries of the tokens this output adds (its last len(new_token_ids))."""
        entries = out.logprobs or []
        return entries[len(entries) - len(out.new_token_ids) :] if out.new_token_ids else []

    @staticmethod
    def usage(num_prompt: int, outs: list[RequestOutput | None], n: int = 1) -> UsageInfo:
        """Prompt tokens once per prompt, completion tokens over every choice (`outs`: the `n` choices of each prompt
        in turn); a prompt's cached tokens are the fewest any of its choices found in the prefix cache."""
        num_completion = sum(len(out.token_ids) for out in outs if out is not None)
        details = None
        if outs and all(out is not None for out in outs):
            groups = [outs[i : i + n] for i in range(0, len(outs), n)]
            cached = sum(min(out.metrics.num_cached_tokens for out in group) for group in groups)
            details = PromptTokensDetails(cached_tokens=cached)
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion, prompt_tokens_details=details)  # fmt: skip

    async def final_outputs(self, outputs: list[AsyncIterator[RequestOutput]], request: Request) -> list[RequestOutput]:
        """Every choice's finished output; aborts them all if the client disconnects first, and the others when one
        fails (the answer is then that error, as a stream ends at its error event)."""
        try:
            return await until_disconnected(request, _all_finished(outputs))
        except EngineDeadError as exc:  # stopped or shutting down: another replica (or later) may serve
            raise APIError(503, str(exc), headers={"Retry-After": RETRY_AFTER_S}) from exc
        except EngineFaultError as exc:
            raise APIError(500, str(exc)) from exc
        except (ValueError, TypeError) as exc:  # the engine refused the request (its own validation)
            raise APIError(400, str(exc)) from exc

    async def sse(
        self, outputs: list[AsyncIterator[RequestOutput]], make_chunks, usage_chunk, usage_so_far=None
    ) -> AsyncIterator[str]:
        """Server-sent events: chunks per output of every choice as they come (`make_chunks(index, output)`; with
        `usage_so_far`, each carrying `usage_so_far(last outputs)`), an error event on an engine fault, then the usage
        chunk (`usage_chunk(last outputs)`) and [DONE]."""
        last: list[RequestOutput | None] = [None] * len(outputs)
        async with aclosing(_merged(outputs)) as merged:
            try:
                async for index, out in merged:
                    if out.finish_reason == "error":
                        raise EngineFaultError(f"engine error while generating this request: {out.error}")
                    last[index] = out
                    for chunk in make_chunks(index, out):
                        if usage_so_far is not None:
                            chunk.usage = usage_so_far(last)
                        yield f"data: {chunk.model_dump_json()}\n\n"
            except (EngineFaultError, EngineDeadError, ValueError, TypeError) as exc:
                # the headers are sent: the status goes into the error event (the engine refused the request: 400;
                # stopped or shutting down: 503; a fault: 500)
                status = 503 if isinstance(exc, EngineDeadError) else 500 if isinstance(exc, EngineFaultError) else 400
                yield f"data: {json.dumps(error_body(status, str(exc)))}\n\n"
                yield "data: [DONE]\n\n"
                return
        if usage_chunk is not None:
            yield f"data: {usage_chunk(last).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"


def grammar_field(body: SamplingFields, plan: ToolPlan | None = None) -> str | None:
    """The request field that sets its grammar: structured_outputs, response_format (other than "text"), or a forced
    call's tool_choice; None without one."""
    if body.structured_outputs is not None:
        return "structured_outputs"
    if body.response_format is not None and body.response_format.type != "text":
        return "response_format"
    if plan is not None and plan.grammar is not None:
        return "tool_choice"
    return None


def continuous_usage(body: SamplingFields) -> bool:
    """stream_options.continuous_usage_stats (vLLM's): every chunk carries the usage so far."""
    return body.stream_options is not None and body.stream_options.continuous_usage_stats


def final_usage(body: SamplingFields) -> bool:
    """stream_options.include_usage (unset: as continuous_usage_stats): a usage chunk ends the stream."""
    return body.stream_options is not None and body.stream_options.final_usage


async def sse_events(chunks: list) -> AsyncIterator[str]:
    """Server-sent events of responses that are all known already (a scored prompt's), then [DONE]."""
    for chunk in chunks:
        yield f"data: {chunk.model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


async def until_disconnected(request: Request, awaitable):
    """`awaitable`'s result, unless the client disconnects first: then it is cancelled (a request's stream aborts
    it in the engine; a score not yet run is skipped) and the answer is a 499. A handler cancelled itself (Ray Serve
    cancels a replica's handler when its client leaves, without an http.disconnect) cancels `awaitable` too: `wait`
    alone would leave it running, the request generating for nobody."""
    task = asyncio.ensure_future(awaitable)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        gone.cancel()
        raise
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise APIError(499, "client disconnected")
    gone.cancel()
    return task.result()


def bad_request(check, *args) -> None:
    """Run one of the engine's input checks (engine/inputs.py, the last argument names the field) before a request
    starts: its ValueError is a 400 naming that field."""
    try:
        check(*args)
    except ValueError as exc:
        raise APIError(400, str(exc), args[-1]) from None


def check_text(text: str, param: str) -> None:
    """400 for text that is not valid Unicode (JSON can carry a lone surrogate; no tokenizer can encode it)."""
    bad_request(inputs.check_text, text, param)


def check_messages(messages: list[ChatMessage]) -> None:
    """`check_text` of every message's text, naming the message (and part) that fails."""
    for i, message in enumerate(messages):
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                check_text(part.text, f"messages[{i}].content[{j}].text")
        elif message.content is not None:
            check_text(message.content, f"messages[{i}].content")


async def _merged(outputs: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(choice index, output) from every choice's stream as each comes; closing it closes (aborts) them all."""
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(outputs)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                index = pending.pop(task)
                try:
                    out = task.result()
                except StopAsyncIteration:
                    continue
                yield index, out
                pending[asyncio.ensure_future(anext(outputs[index]))] = index
    finally:
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for it in outputs:
            await it.aclose()


def finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


def stop_reason(out: RequestOutput) -> int | str | None:
    """vLLM's `stop_reason` of a streamed chunk: what ended the choice, in its last chunk only."""
    return out.stop_reason if out.finished else None


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    if last is not None and last.finish_reason == "error":
        raise EngineFaultError(f"engine error while generating this request: {last.error}")
    return last


async def _all_finished(outputs: list[AsyncIterator[RequestOutput]]) -> list[RequestOutput]:
    """Every choice's finished output, in order; the first choice that fails raises its error and aborts the others
    (cancelled, each stream aborts its request), which would otherwise run on for an answer that is an error."""
    tasks = [asyncio.ensure_future(_last(o)) for o in outputs]
    try:
        for finished in asyncio.as_completed(tasks):
            await finished
        return [task.result() for task in tasks]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
