"""vLLM's tokenizer endpoints: `POST /tokenize` (a prompt, or chat messages rendered as chat completions renders
them), `POST /detokenize`. Like vLLM's they live outside /v1, so they need no API key."""

from __future__ import annotations

import asyncio
import json

from pydantic import ValidationError

from looped_spec.engine import inputs
from looped_spec.server.chat_template import chat_prompt
from looped_spec.server.errors import APIError, validation_message
from looped_spec.server.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from looped_spec.server.serving import OpenAIServing, bad_request, check_messages, check_text


def parse_tokenize_request(raw: bytes) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """The request in its form, told apart as vLLM does: a body with `messages` is chat, any other a prompt (each
    form's own fields, so a field of the other form is a 400 naming it)."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # not JSON (or not UTF-8), or nested past the parser's depth
        raise APIError(400, f"request body is not valid JSON: {exc}") from None
    chat = isinstance(data, dict) and data.get("messages") is not None  # `messages: null` is unset, as any null field
    form = TokenizeChatRequest if chat else TokenizeCompletionRequest
    try:  # validated from Python objects, as FastAPI validates the other endpoints' bodies
        return form.model_validate(data)
    except ValidationError as exc:
        message, param = validation_message(exc.errors())
        raise APIError(400, message, param) from None


async def tokenize(serving: OpenAIServing, body: TokenizeCompletionRequest | TokenizeChatRequest) -> TokenizeResponse:
    """The token ids of the prompt (chat: of the rendered messages, which chat completions would run), their count,
    the server's max_model_len and, with `return_token_strs`, each token as the tokenizer spells it. A template renders
    off the event loop (it is code that may run long); the encoding stays on it (the front's tokenizer is not safe
    to share across threads)."""
    field = "messages" if isinstance(body, TokenizeChatRequest) else "prompt"
    tokenizer = checked_tokenizer(serving, body.model, field)
    if isinstance(body, TokenizeChatRequest):
        check_messages(body.messages)
        tools = [tool.model_dump(exclude_none=True) for tool in body.tools or []] or None
        text = await asyncio.to_thread(chat_prompt, tokenizer, serving.chat_template, body, tools)
        field = "chat_template" if body.chat_template is not None else field  # what an empty rendering is blamed on
    else:
        text = body.prompt
    check_text(text, field)
    ids = tokenizer.encode(text, add_special_tokens=body.add_special_tokens)
    strs = tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
    return TokenizeResponse(count=len(ids), max_model_len=serving.max_model_len, tokens=ids, token_strs=strs)


def detokenize(serving: OpenAIServing, body: DetokenizeRequest) -> DetokenizeResponse:
    """The text of `tokens` (special tokens included, as vLLM decodes them); an id outside the model's vocabulary is
    a 400 naming it."""
    tokenizer = checked_tokenizer(serving, body.model, "tokens")
    bad_request(inputs.check_vocabulary, body.tokens, serving.vocab_size, "tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(body.tokens))


def checked_tokenizer(serving: OpenAIServing, model: str | None, field: str):
    """The server's tokenizer, after the request's `model` (optional here, as in vLLM) is checked."""
    if model is not None:
        serving.check_model(model)
    if serving.tokenizer is None:
        raise APIError(400, f"{field}: the model has no tokenizer", field)
    return serving.tokenizer
