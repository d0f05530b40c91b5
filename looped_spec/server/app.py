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
        # choice i * n + j: prompt i's j-th sample (OpenAI's order); all admitted together or none
        choices = [(ids, j) for ids in prompts for j in range(body.n)]
        params = [serving.sampling_params(body, len(ids), body.max_tokens, j) for ids, j in choices]
        outputs = serving.start_all([ids for ids, _ in choices], params)
        num_prompt = sum(len(ids) for ids in prompts)
        cid = new_id("cmpl")
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
        result = [CompletionChoice(index=k, text=out.text or "", finish_reason=out.finish_reason)
                  for k, out in enumerate(outs)]  # fmt: skip
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
        params = [serving.sampling_params(body, len(ids), max_tokens, j) for j in range(body.n)]
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
        result = [ChatChoice(index=k, message=ChatResponseMessage(content=out.text or ""),
                             finish_reason=out.finish_reason) for k, out in enumerate(outs)]  # fmt: skip
        return ChatCompletionResponse(id=cid, model=model_name, choices=result, usage=serving.usage(len(ids), outs))

    return app
