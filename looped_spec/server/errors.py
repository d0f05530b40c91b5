"""OpenAI-style error bodies, and turning pydantic validation errors into a 400 that names the field."""

from __future__ import annotations

import difflib

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from looped_spec.sampling_params import VLLM_FIELDS
from looped_spec.server.protocol import ErrorInfo, ErrorResponse

#: Request fields vLLM's server takes and this one does not, told with what stands for them, not a guess
VLLM_SERVER_FIELDS = {
    name: VLLM_FIELDS[name] for name in ("truncate_prompt_tokens", "spaces_between_special_tokens", "logits_processors")
} | {
    # a guess would say 'top_logprobs', which scores generated tokens (and only in chat)
    "prompt_logprobs": "not served here: on /v1/completions, echo with logprobs returns the prompt's scores (the first "
    "null; max_tokens 0 scores without generating); offline, SamplingParams.prompt_logprobs",
}
# vLLM's older structured-output fields (in its docs until 0.12; a guess named another field or none)
VLLM_SERVER_FIELDS |= {f"guided_{kind}": f'vLLM\'s older name: send structured_outputs: {{"{kind}": ...}}'
                       for kind in ("json", "regex", "choice", "grammar")}  # fmt: skip
VLLM_SERVER_FIELDS |= {
    "guided_decoding_backend": "not a field here: leave it out (the grammar backend is the server's; vLLM 0.12 "
    "dropped it too)",
}

#: OpenAI's request fields this server does not serve: named as sent, never taken for a misspelling of another
#: (`reasoning_effort` is not a misspelt `response_format`, nor `store` one of `stream`)
OPENAI_FIELDS_NOT_SERVED = frozenset({
    "audio", "function_call", "functions", "metadata", "modalities", "prediction", "prompt_cache_key",
    "reasoning_effort", "safety_identifier", "service_tier", "store", "verbosity", "web_search_options",
})  # fmt: skip

ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               413: "invalid_request_error", 429: "rate_limit_error", 503: "service_unavailable"}  # fmt: skip


class APIError(Exception):
    """An error answered to the client as `{"error": {...}}` with this status."""

    def __init__(self, status: int, message: str, param: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.headers = headers


def error_body(status: int, message: str, param: str | None = None) -> dict:
    kind = ERROR_TYPES.get(status, "invalid_request_error" if 400 <= status < 500 else "server_error")
    info = ErrorInfo(message=message, type=kind, param=param, code=status)
    return ErrorResponse(error=info).model_dump()


def error_response(status: int, message: str, param: str | None = None, headers: dict | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)


def field_path(loc: tuple) -> str:
    """('body', 'messages', 0, 'role') -> 'messages[0].role' (pydantic's union branch names dropped)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, int):
            out += f"[{part}]"
        elif "[" in str(part) or str(part) in ("str", "int", "list", "function-after") or str(part)[:1].isupper():
            continue  # e.g. 'list[int]' / 'str' / 'NamedToolChoice': which union branch pydantic tried
        else:
            out += f".{part}" if out else str(part)
    return out


def unsupported_field_path(loc: tuple) -> str:
    """The path of a field the request sent and no schema has: its own name is the client's, kept whatever it looks
    like (`Temperature`, `int`), where `field_path` would take it for a union branch's name and drop it."""
    parent = field_path(loc[:-1])
    name = str(loc[-1]) if loc else ""
    return f"{parent}.{name}" if parent else name


def _with_guess(loc: tuple) -> str:
    """An unsupported field's path, with the request field it was likely meant to be (`temprature`: did you mean
    `temperature`?), from the fields of every request body this server takes."""
    from looped_spec.server import protocol

    if len(loc) == 2 and loc[0] == "body":  # a field of the request body itself
        models = [protocol.CompletionRequest, protocol.ChatCompletionRequest, protocol.TokenizeCompletionRequest,
                  protocol.TokenizeChatRequest, protocol.DetokenizeRequest]  # fmt: skip
    else:  # inside one of its fields: any part of a request
        models = [m for m in vars(protocol).values() if isinstance(m, type) and issubclass(m, BaseModel)]
    known = sorted({name for model in models for name in model.model_fields})
    name = str(loc[-1]) if loc else ""
    if len(loc) == 2 and name in VLLM_SERVER_FIELDS:  # a vLLM field this server lacks: what stands for it
        return f"{unsupported_field_path(loc)} ({VLLM_SERVER_FIELDS[name]})"
    # a field another endpoint takes (chat's `tools` sent to completions) is named as it is
    close = [] if name in known or name in OPENAI_FIELDS_NOT_SERVED else difflib.get_close_matches(name, known, n=1)
    return unsupported_field_path(loc) + (f" (did you mean {close[0]!r}?)" if close else "")


def validation_message(errors: list[dict]) -> tuple[str, str | None]:
    """Every field in error as 'field: message' (pydantic's text, without its documentation URL), one message per
    top-level field (a union's branches say the same thing several ways), unsupported fields named together; the
    parameter is the first field named."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        msg = first.get("msg", "invalid value")
        return f"request body is not valid JSON: {first.get('ctx', {}).get('error', msg)}", None
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "missing":
        return "the request body is empty: send a JSON object", None
    if tuple(first.get("loc", ())) == ("body",) and first.get("type") == "model_attributes_type":
        if isinstance(first.get("input"), bytes):  # FastAPI reads a body as JSON only under a JSON Content-Type
            return "the request body was not read as JSON: send it with Content-Type: application/json", None
        return "the request body must be a JSON object", None
    parts: list[str] = []
    extra = [_with_guess(tuple(e.get("loc", ()))) for e in errors if e.get("type") == "extra_forbidden"]
    # per top-level field, the error deepest inside it: of a union's branches, the one that got furthest into the
    # value names the part at fault (`prompt[1]`, `messages[0].content[0].text`, `tool_choice.function`)
    deepest: dict[tuple, dict] = {}
    for error in errors:
        loc = tuple(error.get("loc", ()))
        top = loc[:2] if loc[:1] == ("body",) else loc[:1]
        # deeper first, then further along a list (`[[1, 2], "abc"]`: the branch that reached item 1)
        reach = (len(field_path(loc).replace("[", ".").split(".")), tuple(p for p in loc if isinstance(p, int)))
        if error.get("type") != "extra_forbidden" and (top not in deepest or reach > deepest[top][0]):
            deepest[top] = (reach, error)
    seen: set = set()
    param = None
    for error in errors:
        loc = tuple(error.get("loc", ()))
        if error.get("type") == "extra_forbidden":
            path = unsupported_field_path(loc) or None
            if extra:
                what = "a supported field" if len(extra) == 1 else "supported fields"
                parts.append(f"{', '.join(extra)}: not {what}")
                extra = []
        else:
            top = loc[:2] if loc[:1] == ("body",) else loc[:1]
            if top in seen:
                continue
            seen.add(top)
            error = deepest[top][1]
            path = field_path(tuple(error.get("loc", ()))) or None
            msg = error.get("msg", "invalid value").removeprefix("Value error, ")
            parts.append(f"{path}: {msg}" if path else msg)
        param = param if param is not None else path
    return "; ".join(parts), param


async def on_validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_message(list(exc.errors()))
    return error_response(400, message, param)


async def on_api_error(request: Request, exc: APIError) -> JSONResponse:
    return error_response(exc.status, exc.message, exc.param, exc.headers)


async def on_unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    """A bug of the server's own (the traceback goes to its log): still an OpenAI-style body, not plain text."""
    return error_response(500, f"internal server error: {type(exc).__name__}")


async def on_http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None))
