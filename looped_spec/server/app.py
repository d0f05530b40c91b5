"""The OpenAI-compatible HTTP API (FastAPI): completions, chat completions, models, health, metrics."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from looped_spec.async_engine import AsyncLoopedSpecEngine, EngineDeadError, EngineFaultError, QueueFullError
from looped_spec.inputs import load_tokenizer
from looped_spec.request import RequestOutput
from looped_spec.sampling_params import SamplingParams
from looped_spec.server.chat import GenerationDefaults, NoChatTemplateError, render_chat
from looped_spec.server.errors import (
    APIError,
    error_body,
    on_api_error,
    on_http_error,
    on_validation_error,
    validation_message,
)
from looped_spec.server.metrics import ServerMetrics
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
    SamplingFields,
    UsageInfo,
    new_id,
)

MAX_STOP_STRINGS = 16
RETRY_AFTER_S = "1"


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API responses."""

    def __init__(self, engine: AsyncLoopedSpecEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name
        core = engine.engine
        # the engine's tokenizer belongs to its worker thread; the front tokenises with its own copy
        self.tokenizer = load_tokenizer(core.adapter.path)
        self.vocab_size = core.adapter.vocab_size
        self.max_model_len = core.max_model_len
        self.defaults = GenerationDefaults.load(core.adapter.path, self.tokenizer)
        self.metrics = ServerMetrics(core, model_name)

    # ----- request -> engine -----
    def check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} does not exist; this server serves {self.model_name!r}", "model")

    def prompt_ids(self, prompt, param: str = "prompt") -> list[int]:
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) != 1:
                raise APIError(400, f"{param}: one prompt per request is supported (got {len(prompt)})", param)
            prompt = prompt[0]
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise APIError(400, f"{param}: the model has no tokenizer; send token ids", param)
            ids = self.tokenizer.encode(prompt, add_special_tokens=False)
        else:
            ids = list(prompt)
            bad = next((i for i, t in enumerate(ids) if not 0 <= t < self.vocab_size), None)
            if bad is not None:
                raise APIError(400, f"{param}[{bad}] = {ids[bad]} is outside the vocabulary [0, {self.vocab_size})",
                               param)  # fmt: skip
        if not ids:
            raise APIError(400, f"{param} is empty", param)
        if len(ids) >= self.max_model_len:
            raise APIError(400, f"{param}: {len(ids)} tokens; must be fewer than max_model_len={self.max_model_len}",
                           param)  # fmt: skip
        return ids

    def sampling_params(self, body: SamplingFields, num_prompt_tokens: int, max_tokens: int | None) -> SamplingParams:
        room = self.max_model_len - num_prompt_tokens
        if max_tokens is None:
            max_tokens = room
        elif max_tokens > room:
            raise APIError(400, f"max_tokens: {max_tokens} + {num_prompt_tokens} prompt tokens exceeds "
                           f"max_model_len={self.max_model_len}", "max_tokens")  # fmt: skip
        stop = body.stop_list()
        if len(stop) > MAX_STOP_STRINGS:
            raise APIError(400, f"stop: at most {MAX_STOP_STRINGS} stop strings", "stop")
        stop_token_ids = list(body.stop_token_ids or [])
        if not body.ignore_eos:
            stop_token_ids += [t for t in self.defaults.eos_token_ids if t not in stop_token_ids]
        d = self.defaults
        try:
            return SamplingParams(
                max_tokens=max_tokens,
                temperature=d.temperature if body.temperature is None else body.temperature,
                top_p=d.top_p if body.top_p is None else body.top_p,
                top_k=d.top_k if body.top_k is None else body.top_k,
                seed=body.seed,
                stop=stop,
                stop_token_ids=stop_token_ids,
                ignore_eos=body.ignore_eos,
            )
        except ValidationError as exc:
            message, param = validation_message(exc.errors())
            raise APIError(400, message, param) from exc

    def start(self, ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        """Admit the request now (429 / 503 before any response starts); its outputs, timed."""
        try:
            stream = self.engine.add_request(ids, params)
        except QueueFullError as exc:
            raise APIError(429, f"server busy: {exc}; retry later", headers={"Retry-After": RETRY_AFTER_S}) from exc
        except EngineDeadError as exc:
            raise APIError(503, str(exc), headers={"Retry-After": RETRY_AFTER_S}) from exc
        return self.metrics.timed(aiter(stream), time.perf_counter())

    # ----- engine -> response -----
    @staticmethod
    def usage(num_prompt: int, out: RequestOutput | None) -> UsageInfo:
        num_completion = len(out.token_ids) if out is not None else 0
        return UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_completion,
                         total_tokens=num_prompt + num_completion)  # fmt: skip

    async def final_output(self, outputs: AsyncIterator[RequestOutput], request: Request) -> RequestOutput:
        """The finished output; aborts the request if the client disconnects first."""
        async with aclosing(outputs):
            task = asyncio.ensure_future(_last(outputs))
            gone = asyncio.ensure_future(_disconnected(request))
            await asyncio.wait({task, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not task.done():
                task.cancel()  # the request's stream aborts it in the engine
                await asyncio.gather(task, return_exceptions=True)
                raise APIError(499, "client disconnected")
            gone.cancel()
            try:
                out = task.result()
            except (EngineFaultError, EngineDeadError) as exc:
                raise APIError(500, str(exc)) from exc
        if out.finish_reason == "error":
            raise APIError(500, "engine error while generating this request")
        return out

    async def sse(self, outputs: AsyncIterator[RequestOutput], make_chunks, usage_chunk) -> AsyncIterator[str]:
        """Server-sent events: chunks per output, an error event on an engine fault, then [DONE]."""
        last = None
        async with aclosing(outputs):
            try:
                async for out in outputs:
                    if out.finish_reason == "error":
                        raise EngineFaultError("engine error while generating this request")
                    last = out
                    for chunk in make_chunks(out):
                        yield f"data: {chunk.model_dump_json()}\n\n"
            except (EngineFaultError, EngineDeadError) as exc:
                yield f"data: {json.dumps(error_body(500, str(exc)))}\n\n"
                yield "data: [DONE]\n\n"
                return
        if usage_chunk is not None:
            yield f"data: {usage_chunk(last).model_dump_json()}\n\n"
        yield "data: [DONE]\n\n"


def _finish_reason(out: RequestOutput) -> str | None:
    return out.finish_reason if out.finished else None


async def _last(outputs: AsyncIterator[RequestOutput]) -> RequestOutput:
    last = None
    async for out in outputs:
        last = out
    return last


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


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
        ids = serving.prompt_ids(body.prompt)
        params = serving.sampling_params(body, len(ids), body.max_tokens)
        outputs = serving.start(ids, params)
        cid = new_id("cmpl")
        if body.stream:

            def chunks(out: RequestOutput):
                if out.new_text or out.finished:
                    choice = CompletionChoice(text=out.new_text, finish_reason=_finish_reason(out))
                    yield CompletionResponse(id=cid, model=model_name, choices=[choice])

            usage = None
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = lambda out: CompletionResponse(id=cid, model=model_name, choices=[],
                                                       usage=serving.usage(len(ids), out))  # fmt: skip
            return StreamingResponse(serving.sse(outputs, chunks, usage), media_type="text/event-stream")
        out = await serving.final_output(outputs, request)
        choice = CompletionChoice(text=out.text or "", finish_reason=out.finish_reason)
        return CompletionResponse(id=cid, model=model_name, choices=[choice], usage=serving.usage(len(ids), out))

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
        params = serving.sampling_params(body, len(ids), max_tokens)
        outputs = serving.start(ids, params)
        cid = new_id("chatcmpl")
        if body.stream:
            first = True

            def chunks(out: RequestOutput):
                nonlocal first
                if first:  # OpenAI streams the role first
                    first = False
                    delta = DeltaMessage(role="assistant", content="")
                    yield ChatCompletionChunk(id=cid, model=model_name, choices=[ChatStreamChoice(delta=delta)])
                if out.new_text or out.finished:
                    choice = ChatStreamChoice(delta=DeltaMessage(content=out.new_text or None),
                                              finish_reason=_finish_reason(out))  # fmt: skip
                    yield ChatCompletionChunk(id=cid, model=model_name, choices=[choice])

            usage = None
            if body.stream_options is not None and body.stream_options.include_usage:
                usage = lambda out: ChatCompletionChunk(id=cid, model=model_name, choices=[],
                                                        usage=serving.usage(len(ids), out))  # fmt: skip
            return StreamingResponse(serving.sse(outputs, chunks, usage), media_type="text/event-stream")
        out = await serving.final_output(outputs, request)
        choice = ChatChoice(message=ChatResponseMessage(content=out.text or ""), finish_reason=out.finish_reason)
        return ChatCompletionResponse(id=cid, model=model_name, choices=[choice], usage=serving.usage(len(ids), out))

    return app
