"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics; vLLM's
/tokenize, /detokenize and /version."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from looped_spec import __version__
from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
from looped_spec.reasoning import ReasoningStream
from looped_spec.request import RequestOutput
from looped_spec.server.chat_template import ChatTemplateConfig, chat_prompt
from looped_spec.server.errors import (
    APIError,
    on_api_error,
    on_http_error,
    on_unexpected_error,
    on_validation_error,
)
from looped_spec.server.middleware import APIKeyMiddleware, BodyLimitMiddleware, ReplicaHeaderMiddleware
from looped_spec.server.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatResponseMessage,
    ChatStreamChoice,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DeltaMessage,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeResponse,
    UsageInfo,
    VersionResponse,
    new_id,
    now,
)
from looped_spec.server.serving import (
    OpenAIServing,
    check_messages,
    continuous_usage,
    final_usage,
    finish_reason,
    sse_events,
    stop_reason,
    until_disconnected,
)
from looped_spec.server.tokenize import detokenize, parse_tokenize_request, tokenize
from looped_spec.server.tool_stream import ToolCallStream
from looped_spec.server.tools import ToolCallingConfig, plan_tools, tool_message
from looped_spec.token_bytes import TextOffsets


def build_app(
    engine: AsyncLoopedSpecEngine,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
    replica: str | None = None,
    readiness: Callable[[], Awaitable[str | None]] | None = None,
    tool_calling: ToolCallingConfig | None = None,
    chat_template: ChatTemplateConfig | None = None,
    reasoning_parser: str | None = None,
    return_tokens_as_token_ids: bool = False,
) -> FastAPI:
    """The FastAPI app around a started-on-startup async engine.

    Behind a router of replicas (server/replicas.py) `replica` names this one: every /metrics series carries it as
    a `replica` label and every response an `x-looped-spec-replica` header; `readiness()` returns why the whole
    deployment is not ready yet (None once it is), and /health reports it. `tool_calling`: whether `tool_choice:
    "auto"` is served, and with which parser (server/tools.py). `chat_template`: the server's template and whether a
    request may bring its own (server/chat_template.py). `reasoning_parser`: how chat replies' reasoning is taken
    apart from their content (looped_spec/reasoning.py; None: replies as generated). `return_tokens_as_token_ids`:
    log-probabilities show tokens as "token_id:<id>" unless a request says otherwise.
    """
    serving = OpenAIServing(engine, model_name, tool_calling, chat_template, reasoning_parser,
                            return_tokens_as_token_ids)  # fmt: skip
    exposed = serving.metrics.exposed({"replica": replica} if replica else None)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="looped-spec", lifespan=lifespan)
    app.state.serving = serving
    app.state.metrics_registry = exposed
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    app.add_exception_handler(Exception, on_unexpected_error)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # outermost: runs before auth
    if replica:
        app.add_middleware(ReplicaHeaderMiddleware, replica=replica)

    @app.get("/health")
    async def health() -> Response:
        extra = {"replica": replica} if replica else {}
        if not engine.is_running:
            return JSONResponse({"status": "engine stopped", **extra}, status_code=503)
        waiting_for = await readiness() if readiness is not None else None
        if waiting_for is not None:
            return JSONResponse({"status": f"not ready: {waiting_for}", **extra}, status_code=503)
        return JSONResponse({"status": "ok", **extra})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(exposed), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[serving.model_card()])

    @app.get("/v1/models/{model:path}")
    async def model_card(model: str) -> ModelCard:
        serving.check_model(model)
        return serving.model_card()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        serving.check_request(body)
        as_ids = serving.tokens_shown_as_ids(body)  # log-probabilities' tokens as "token_id:<id>"
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 generates nothing; with echo it returns (and scores) the prompt",
                           "max_tokens")  # fmt: skip
        score_only = body.max_tokens == 0
        prompts = serving.prompt_lists(body.prompt, scored_only=score_only, add_special_tokens=body.add_special_tokens)
        scored = body.logprobs is not None
        # the prompt's scores (echo) come from a forward run afterwards with the seed the choice prefilled with
        seed = serving.scoring_seed(body, scored and body.echo)
        # choice i * n + j: prompt i's j-th sample (OpenAI's order); all admitted together or none
        choices = [(ids, j) for ids in prompts for j in range(body.n)]
        serving.check_choices(len(choices), body.n)
        # score only (max_tokens 0): the parameters still carry the seed the scores depend on (a family drawing its
        # initial state per token); prompts are scored at full depth (the early-exit fields are refused)
        max_tokens = 1 if score_only else serving.completion_tokens(body)
        serving.check_masks_beside_grammar(body)
        await serving.check_grammar(body, score_only)
        params = [serving.sampling_params(body, len(ids), max_tokens, j, seed, body.logprobs, score_only)
                  for ids, j in choices]  # fmt: skip
        num_prompt = sum(len(ids) for ids in prompts)
        cid, created = new_id("cmpl"), now()

        def response(items: list[CompletionChoice], usage: UsageInfo | None = None) -> CompletionResponse:
            return CompletionResponse(id=cid, created=created, model=model_name, choices=items, usage=usage)

        async def echoed() -> list[tuple[str, list | None]]:
            """Every choice's prompt as echo returns it: its text and, with logprobs, its entries (the first None);
            scored one after another, each holding a place among the in-flight requests while it runs."""
            out = []
            for (ids, _), choice_params in zip(choices, params):
                text = serving.tokenizer.decode(ids) if serving.tokenizer is not None else ""
                out.append((text, await serving.score(ids, body.logprobs, choice_params.seed) if scored else None))
            return out

        echoes = await until_disconnected(request, echoed()) if body.echo else None
        # return_token_ids (vLLM's): each choice its prompt's ids and the ids it generated (None: left out)
        want_ids = body.return_token_ids
        if score_only:
            result = []
            for k, ((ids, _), (text, entries)) in enumerate(zip(choices, echoes)):
                logprobs = (
                    serving.completion_logprobs(ids, entries, as_ids=as_ids, starts_text=True) if scored else None
                )
                result.append(CompletionChoice(index=k, text=text, logprobs=logprobs, finish_reason="length",
                                               prompt_token_ids=ids if want_ids else None,
                                               token_ids=[] if want_ids else None))  # fmt: skip
            usage = serving.usage(num_prompt, [None] * len(choices))
            if not body.stream:
                return response(result, usage)
            so_far = usage if continuous_usage(body) else None  # scoring generates nothing: the usage is final
            chunks = [response([choice], so_far) for choice in result]
            if final_usage(body):
                chunks.append(response([], usage))
            return StreamingResponse(sse_events(chunks), media_type="text/event-stream")
        outputs = serving.start_all([ids for ids, _ in choices], params, body.priority, body.cache_salt)
        if body.stream:
            offsets = [TextOffsets() for _ in choices]  # each choice's text offsets, across its chunks
            prompt_sent = [False] * len(choices)  # return_token_ids: the prompt's ids go in a choice's first chunk

            def ids_of(index: int, new_ids: list[int]) -> dict:
                """A chunk's return_token_ids fields: the ids it adds, and the prompt's in the choice's first."""
                if not want_ids:
                    return {}
                first, prompt_sent[index] = not prompt_sent[index], True
                return {"token_ids": list(new_ids), "prompt_token_ids": choices[index][0] if first else None}

            def chunks(index: int, out: RequestOutput):
                if echoes is not None and echoes[index] is not None:  # the prompt first, once
                    text, entries = echoes[index]
                    echoes[index] = None
                    logprobs = None
                    if scored:
                        logprobs = serving.completion_logprobs(choices[index][0], entries, offsets[index], as_ids,
                                                               starts_text=True)  # fmt: skip
                    yield response([CompletionChoice(index=index, text=text, logprobs=logprobs, **ids_of(index, []))])
                logprobs = None
                if scored and out.new_token_ids:
                    logprobs = serving.completion_logprobs(out.new_token_ids, serving.new_logprobs(out), offsets[index],
                                                          as_ids)  # fmt: skip
                # with return_token_ids every new id is sent, text or not (a model without a tokenizer has none)
                if out.new_text or out.finished or logprobs is not None or (want_ids and out.new_token_ids):
                    choice = CompletionChoice(index=index, text=out.new_text, logprobs=logprobs,
                                              finish_reason=finish_reason(out), stop_reason=stop_reason(out),
                                              **ids_of(index, out.new_token_ids))  # fmt: skip
                    yield response([choice])

            usage = so_far = None
            if final_usage(body):
                usage = lambda outs: response([], serving.usage(num_prompt, outs, body.n))
            if continuous_usage(body):
                so_far = lambda outs: serving.usage(num_prompt, outs, body.n)
            return StreamingResponse(serving.sse(outputs, chunks, usage, so_far), media_type="text/event-stream")
        outs = await serving.final_outputs(outputs, request)
        result = []
        for k, ((ids, _), out) in enumerate(zip(choices, outs)):
            text, tokens, entries = out.text or "", list(out.token_ids), out.logprobs or []
            if echoes is not None:  # the prompt first, its text and its entries
                prompt_text, prompt_entries = echoes[k]
                text, tokens, entries = prompt_text + text, ids + tokens, (prompt_entries or []) + entries
            starts_text = echoes is not None  # the prompt's first token begins the text
            logprobs = (
                serving.completion_logprobs(tokens, entries, as_ids=as_ids, starts_text=starts_text) if scored else None
            )
            # the ids the engine generated (a stop string's tokens too, cut from the text), never the echoed prompt's
            result.append(CompletionChoice(index=k, text=text, logprobs=logprobs, finish_reason=out.finish_reason,
                                           stop_reason=out.stop_reason, prompt_token_ids=ids if want_ids else None,
                                           token_ids=list(out.token_ids) if want_ids else None))  # fmt: skip
        return response(result, serving.usage(num_prompt, outs, body.n))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        serving.check_request(body)
        as_ids = serving.tokens_shown_as_ids(body)  # log-probabilities' tokens as "token_id:<id>"
        check_messages(body.messages)
        plan = plan_tools(body, serving.tool_calling)
        # rendered off the event loop: a template is code that may run long (a trusted request's own, or a server's)
        prompt = await asyncio.to_thread(chat_prompt, serving.tokenizer, serving.chat_template, body,
                                         plan.template_tools)  # fmt: skip
        rendered_by = "chat_template" if body.chat_template is not None else "messages"  # blamed for its length
        ids = serving.prompt_ids(prompt, rendered_by, add_special_tokens=body.add_special_tokens)
        # echo (vLLM's): the reply starts with the last message's content when that message is the assistant's
        last = body.messages[-1]
        echoed = last.text() if body.echo and last.role == "assistant" else ""
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        top_n = (body.top_logprobs or 0) if body.logprobs else None
        reasoning_end = serving.check_reasoning(body, plan, ids)  # where a grammar starts: after the reasoning
        serving.check_masks_beside_grammar(body, plan)
        await serving.check_grammar(body)
        await serving.check_tool_grammar(plan)
        generating = plan.generation_fields(body)
        reasoning = serving.reasoning  # chat replies' reasoning apart from their content (looped_spec/reasoning.py)
        given = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = [serving.sampling_params(generating, len(ids), max_tokens, j, None, top_n, reasoning_end=reasoning_end,
                                          max_tokens_field=given) for j in range(body.n)]  # fmt: skip
        if body.top_logprobs and not body.logprobs:  # 0 asks for nothing: taken, as vLLM takes it
            raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        serving.check_choices(body.n, body.n)
        outputs = serving.start_all([ids] * body.n, params, body.priority, body.cache_salt)
        cid, created = new_id("chatcmpl"), now()
        want_ids = body.return_token_ids  # vLLM's: the rendered chat's ids, and each choice's generated ids

        def chunk(
            items: list[ChatStreamChoice], usage: UsageInfo | None = None, prompt_ids: list[int] | None = None
        ) -> ChatCompletionChunk:
            return ChatCompletionChunk(id=cid, created=created, model=model_name, choices=items, usage=usage,
                                       prompt_token_ids=prompt_ids)  # fmt: skip

        def ids_if_asked(token_ids: list[int]) -> list[int] | None:
            """A choice's `token_ids` (a chunk's: those it adds) with return_token_ids; None, left out, without."""
            return list(token_ids) if want_ids else None

        if body.stream:
            streams = [ToolCallStream(plan) for _ in range(body.n)]
            thoughts = [ReasoningStream(reasoning) for _ in range(body.n)] if reasoning is not None else None
            # a message that may be all calls starts with content null, as OpenAI's (a text answer with ""), and so
            # does one that may be all reasoning
            text_only = plan.mode == "none" and reasoning is None
            role = DeltaMessage(role="assistant", content="" if text_only else None)

            def chunks(index: int, out: RequestOutput):
                if not streams[index].started:  # every choice's role first, in index order (the first chunk
                    fresh = [k for k, stream in enumerate(streams) if not stream.started]  # must be choice 0's:
                    opening = len(fresh) == len(streams)  # the answer's first chunk carries the prompt's ids
                    for k in fresh:  # the openai client builds on it), then what echo repeats, before any token
                        streams[k].started = True
                        first = opening and k == fresh[0] and want_ids
                        yield chunk([ChatStreamChoice(index=k, delta=role, token_ids=ids_if_asked([]))],
                                    prompt_ids=ids if first else None)  # fmt: skip
                    for k in fresh if echoed else ():
                        yield chunk([ChatStreamChoice(index=k, delta=DeltaMessage(content=echoed),
                                                      token_ids=ids_if_asked([]))])  # fmt: skip
                logprobs = None
                if body.logprobs and out.new_token_ids:
                    logprobs = serving.chat_logprobs(serving.new_logprobs(out), as_ids)
                new_text, thought = out.new_text, ""
                if thoughts is not None:  # the tool stream sees the content alone
                    thought, new_text = thoughts[index].feed(out.new_text, out.finished)
                delta, reason = streams[index].delta(new_text, out.finished, finish_reason(out))
                if thought and body.include_reasoning:
                    delta = (delta or DeltaMessage()).model_copy(update={"reasoning": thought})
                token_ids = out.new_token_ids  # the raw ids, whatever the parsers hold back or make of their text
                if reason is not None and delta is not None and delta.tool_calls:
                    # the finish reason in a chunk of its own, as OpenAI sends it: the client closes a call
                    # (its `arguments.done` event) only on a chunk after the one that carried the call
                    yield chunk([ChatStreamChoice(index=index, delta=delta, logprobs=logprobs,
                                                  token_ids=ids_if_asked(token_ids))])  # fmt: skip
                    delta, logprobs, token_ids = None, None, []
                if delta is not None or out.finished or logprobs is not None or (want_ids and token_ids):
                    choice = ChatStreamChoice(index=index, delta=delta or DeltaMessage(), logprobs=logprobs,
                                              finish_reason=reason, stop_reason=stop_reason(out),
                                              token_ids=ids_if_asked(token_ids))  # fmt: skip
                    yield chunk([choice])

            usage = so_far = None
            if final_usage(body):
                usage = lambda outs: chunk([], serving.usage(len(ids), outs, body.n))
            if continuous_usage(body):
                so_far = lambda outs: serving.usage(len(ids), outs, body.n)
            return StreamingResponse(serving.sse(outputs, chunks, usage, so_far), media_type="text/event-stream")
        outs = await serving.final_outputs(outputs, request)
        result = []
        for k, out in enumerate(outs):
            logprobs = serving.chat_logprobs(out.logprobs or [], as_ids) if body.logprobs else None
            text, thought = out.text or "", None
            if reasoning is not None:
                split = reasoning.split(text)
                text, thought = split.content or "", split.reasoning or None
            message = tool_message(plan, text, out.finish_reason)
            content = echoed + (message.content or "") if echoed else message.content
            if reasoning is not None and not content:
                content = None  # all reasoning, or all calls: no content (what the streamed deltas add up to)
            reply = ChatResponseMessage(content=content, tool_calls=message.tool_calls,
                                        reasoning=thought if body.include_reasoning else None)  # fmt: skip
            result.append(ChatChoice(index=k, logprobs=logprobs, finish_reason=message.finish_reason,
                                     stop_reason=out.stop_reason, message=reply,
                                     token_ids=ids_if_asked(out.token_ids)))  # fmt: skip
        return ChatCompletionResponse(id=cid, created=created, model=model_name, choices=result,
                                      usage=serving.usage(len(ids), outs, body.n),
                                      prompt_token_ids=ids if want_ids else None)  # fmt: skip

    @app.post("/tokenize")
    async def tokenize_endpoint(request: Request) -> TokenizeResponse:
        # two request forms, told apart by their fields (server/tokenize.py), so the body is parsed here
        return await tokenize(serving, parse_tokenize_request(await request.body()))

    @app.post("/detokenize")
    async def detokenize_endpoint(body: DetokenizeRequest) -> DetokenizeResponse:
        return detokenize(serving, body)

    @app.get("/version")
    async def version() -> VersionResponse:
        return VersionResponse(version=__version__)

    return app
