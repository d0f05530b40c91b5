"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics."""

from __future__ import annotations

from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
from looped_spec.request import RequestOutput
from looped_spec.server.chat import NoChatTemplateError, render_chat
from looped_spec.server.errors import APIError, on_api_error, on_http_error, on_validation_error
from looped_spec.server.middleware import APIKeyMiddleware, BodyLimitMiddleware
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
    ModelCard,
    ModelList,
    new_id,
)
from looped_spec.server.serving import OpenAIServing, finish_reason


def build_app(
    engine: AsyncLoopedSpecEngine,
    model_name: str,
    api_key: str | None = None,
    max_body_bytes: int = 1 << 20,
) -> FastAPI:
    """The FastAPI app around a started-on-startup async engine."""
    serving = OpenAIServing(engine, model_name)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="looped-spec", lifespan=lifespan)
    app.state.serving = serving
    app.add_exception_handler(RequestValidationError, on_validation_error)
    app.add_exception_handler(APIError, on_api_error)
    app.add_exception_handler(StarletteHTTPException, on_http_error)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(BodyLimitMiddleware, max_bytes=max_body_bytes)  # outermost: runs before auth

    @app.get("/health")
    async def health() -> Response:
        if not engine.is_running:
            return JSONResponse({"status": "engine stopped"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(serving.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=model_name, max_model_len=serving.max_model_len)])

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        serving.check_model(body.model)
        prompts = serving.prompt_lists(body.prompt)
        if body.max_tokens == 0 and not body.echo:
            raise APIError(400, "max_tokens: 0 generates nothing; with echo it returns (and scores) the prompt",
                           "max_tokens")  # fmt: skip
        scored = body.logprobs is not None
        seed = serving.scoring_seed(body, scored)
        # choice i * n + j: prompt i's j-th sample (OpenAI's order); all admitted together or none
        choices = [(ids, j) for ids in prompts for j in range(body.n)]
        # score only (max_tokens 0): the parameters still carry the seed and the exit fields the scores depend on
        max_tokens = 1 if body.max_tokens == 0 else body.max_tokens
        params = [serving.sampling_params(body, len(ids), max_tokens, j, seed) for ids, j in choices]
        if scored:
            serving.check_logprobs(params[0], body.stream, "logprobs")
        if body.echo and body.stream:
            raise APIError(400, "echo: not available with stream (yet); ask without stream", "echo")
        num_prompt = sum(len(ids) for ids in prompts)
        cid = new_id("cmpl")
        if body.max_tokens == 0:  # score only
            outs = [None] * len(choices)
        else:
            outputs = serving.start_all([ids for ids, _ in choices], params)
            if body.stream:

                def chunks(index: int, out: RequestOutput):
                    if out.new_text or out.finished:
                        choice = CompletionChoice(index=index, text=out.new_text, finish_reason=finish_reason(out))
                        yield CompletionResponse(id=cid, model=model_name, choices=[choice])

                usage = None
                if body.stream_options is not None and body.stream_options.include_usage:
                    usage = lambda outs: CompletionResponse(id=cid, model=model_name, choices=[],
                                                            usage=serving.usage(num_prompt, outs))  # fmt: skip
                return StreamingResponse(serving.sse(outputs, chunks, usage), media_type="text/event-stream")
            outs = await serving.final_outputs(outputs, request)
        result = []
        for k, ((ids, _), out) in enumerate(zip(choices, outs)):
            generated = list(out.token_ids) if out is not None else []
            text = (out.text or "") if out is not None else ""
            logprobs = None
            if scored:
                entries = await serving.score(ids + generated, body.logprobs, params[k].seed)
                shown = ids + generated if body.echo else generated
                logprobs = serving.completion_logprobs(shown, entries if body.echo else entries[len(ids) :])
            if body.echo:
                text = serving.tokenizer.decode(ids) + text if serving.tokenizer is not None else text
            reason = out.finish_reason if out is not None else "length"
            result.append(CompletionChoice(index=k, text=text, logprobs=logprobs, finish_reason=reason))
        return CompletionResponse(id=cid, model=model_name, choices=result, usage=serving.usage(num_prompt, outs))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request):
        serving.check_model(body.model)
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            prompt = render_chat(serving.tokenizer, messages, body.add_generation_prompt)
        except NoChatTemplateError as exc:
            raise APIError(400, str(exc), "messages") from exc
        ids = serving.prompt_ids(prompt, "messages")
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        seed = serving.scoring_seed(body, body.logprobs)
        params = [serving.sampling_params(body, len(ids), max_tokens, j, seed) for j in range(body.n)]
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs: needs logprobs: true", "top_logprobs")
        if body.logprobs:
            serving.check_logprobs(params[0], body.stream, "logprobs")
        outputs = serving.start_all([ids] * body.n, params)
        cid = new_id("chatcmpl")
        if body.stream:
            started: set[int] = set()

            def chunks(index: int, out: RequestOutput):
                if index not in started:  # OpenAI streams each choice's role first
                    started.add(index)
                    delta = DeltaMessage(role="assistant", content="")
                    yield ChatCompletionChunk(id=cid, model=model_name,
                                              choices=[ChatStreamChoice(index=index, delta=delta)])  # fmt: skip
                if out.new_text or out.finished:
                    choice = ChatStreamChoice(index=index, delta=DeltaMessage(content=out.new_text or None),
                                              finish_reason=finish_reason(out))  # fmt: skip
                    yield ChatCompletionChunk(id=cid, model=model_name, choices=[choice])

            usage = None
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = lambda outs: ChatCompletionChunk(id=cid, model=model_name, choices=[],
                                                         usage=serving.usage(len(ids), outs))  # fmt: skip
            return StreamingResponse(serving.sse(outputs, chunks, usage), media_type="text/event-stream")
        outs = await serving.final_outputs(outputs, request)
        result = []
        for k, out in enumerate(outs):
            logprobs = None
            if body.logprobs:
                entries = await serving.score(ids + list(out.token_ids), body.top_logprobs or 0, params[k].seed)
                logprobs = serving.chat_logprobs(entries[len(ids) :])
            result.append(ChatChoice(index=k, message=ChatResponseMessage(content=out.text or ""), logprobs=logprobs,
                                     finish_reason=out.finish_reason))  # fmt: skip
        return ChatCompletionResponse(id=cid, model=model_name, choices=result, usage=serving.usage(len(ids), outs))

    return app
