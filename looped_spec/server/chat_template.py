"""Which chat template renders a chat request's prompt, and with what, as vLLM serves it.

- `--chat-template T` (the server's): T is a file, or the template itself (vLLM's rule, `read_chat_template`); it
  replaces the tokenizer's own template for every request, so a model without one serves chat too.
- `chat_template` (a request's own): taken only by a server started with `--trust-request-chat-template` (vLLM
  refuses it by default too: a template is code the server runs, in transformers' Jinja sandbox).
- `chat_template_kwargs`: extra template variables; the ones the template does not read are dropped (vLLM's rule, so
  a client may send e.g. `enable_thinking` to every model), the names transformers' renderer takes itself refused.
- `continue_final_message`: the last message is left open for the model to continue (needs `add_generation_prompt:
  false`; transformers cuts the rendered text after that message's content).

Every failure of a template on a request is a 400 naming the field to blame, never a 500.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Any

from jinja2 import TemplateError, TemplateSyntaxError, meta
from pydantic import BaseModel, ConfigDict, field_validator
from transformers.utils.chat_template_utils import _compile_jinja_template

from looped_spec.engine.chat import NO_TOKENIZER_FOR_CHAT, NoChatTemplateError, render_chat, rendering_parameters
from looped_spec.server.errors import APIError
from looped_spec.server.tools import template_message

#: a value that names no file and holds none of these is a mistyped path, not a template written inline (vLLM's rule)
TEMPLATE_CHARS = "{}\n"
TRUST_FLAG = "--trust-request-chat-template"


def read_chat_template(value: str) -> str:
    """The template `value` stands for: the text of the file it names, else `value` itself when it holds `{`, `}` or a
    newline (a template written inline). A ValueError for a value that looks like a path but does not open."""
    try:
        return Path(value).read_text(encoding="utf-8")
    except (OSError, ValueError) as exc:  # ValueError: not UTF-8, or a NUL in the name
        if any(char in value for char in TEMPLATE_CHARS):
            return value
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ValueError(f"{value!r} looks like a file path, but it does not open ({reason}); a template written "
                         "inline holds '{', '}' or a newline") from None  # fmt: skip


def check_chat_template(source: str) -> None:
    """A ValueError naming the syntax error (and its line) when `source` does not compile as transformers compiles
    chat templates (its sandbox and extensions)."""
    try:
        _compile_jinja_template(source)
    except TemplateSyntaxError as exc:
        raise ValueError(f"does not parse: {exc.message} (line {exc.lineno})") from None
    except TemplateError as exc:
        raise ValueError(f"does not parse: {exc}") from None


@lru_cache(maxsize=64)
def template_variables(source: str) -> frozenset[str]:
    """The variables `source` reads that it does not set itself (where `chat_template_kwargs` can reach it)."""
    environment = _compile_jinja_template(source).environment
    return frozenset(meta.find_undeclared_variables(environment.parse(source)))


#: rendering parameters a chat request sets with a field of its own
REQUEST_FIELDS = ("chat_template", "add_generation_prompt", "continue_final_message", "tools", "messages")


class ChatTemplateConfig(BaseModel):
    """The server's chat template settings (flags `--chat-template`, `--trust-request-chat-template`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    #: the template's text (`--chat-template` reads a file first); None: the tokenizer's own
    chat_template: str | None = None
    trust_request_chat_template: bool = False

    @field_validator("chat_template")
    @classmethod
    def _compiles(cls, value: str | None) -> str | None:
        if value is not None:
            check_chat_template(value)
        return value


def template_kwargs(source: str, kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """The request's `chat_template_kwargs` that `source` reads. A rendering parameter is a 400 naming it."""
    for name in kwargs or {}:
        if name in rendering_parameters():
            field = f"chat_template_kwargs.{name}"
            hint = f"; set the request's {name} field" if name in REQUEST_FIELDS else ""
            raise APIError(400, f"{field}: a rendering parameter, not a template variable{hint}", field)
    wanted = template_variables(source)
    return {name: value for name, value in (kwargs or {}).items() if name in wanted}


def template_source(tokenizer, config: ChatTemplateConfig, body: Any, tools: list[dict] | None) -> tuple[str, str]:
    """(The template that renders `body`, the field a failure of it is blamed on): the request's own (gated by
    the server's trust), the server's `--chat-template`, or the tokenizer's."""
    if tokenizer is None:  # no template helps
        raise NoChatTemplateError(NO_TOKENIZER_FOR_CHAT)
    if body.chat_template is not None:
        if not config.trust_request_chat_template:
            raise APIError(400, f"chat_template: this server does not run a request's own chat template; start it "
                           f"with {TRUST_FLAG} to allow that", "chat_template")  # fmt: skip
        try:
            check_chat_template(body.chat_template)
        except ValueError as exc:
            raise APIError(400, f"chat_template: {exc}", "chat_template") from None
        return body.chat_template, "chat_template"
    if config.chat_template is not None:
        return config.chat_template, "messages"
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError("this model's tokenizer has no chat_template; use /v1/completions with a plain "
                                  "prompt, or start the server with --chat-template")  # fmt: skip
    return tokenizer.get_chat_template(None, tools), "messages"


def chat_prompt(tokenizer, config: ChatTemplateConfig, body: Any, tools: list[dict] | None) -> str:
    """The prompt text of a chat request (`ChatTemplateFields`: chat completions, /tokenize); `tools` in OpenAI's
    shape reach the template as its `tools`. Every failure is a 400 naming the field to blame."""
    if body.continue_final_message and body.add_generation_prompt:
        field = "continue_final_message"
        raise APIError(400, f"{field}: cannot be true with add_generation_prompt true (its default); set "
                       "add_generation_prompt: false to continue the final message", field)  # fmt: skip
    try:
        source, blamed = template_source(tokenizer, config, body, tools)
    except NoChatTemplateError as exc:
        raise APIError(400, str(exc), "messages") from exc
    variables = template_kwargs(source, body.chat_template_kwargs)
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    try:
        return render_chat(tokenizer, messages, body.add_generation_prompt, tools, chat_template=source,
                           continue_final_message=body.continue_final_message, template_kwargs=variables)  # fmt: skip
    except RecursionError as exc:  # a tool's schema (or a message) nested deeper than the template can walk
        field = "tools" if tools else "messages"
        raise APIError(400, f"{field}: nested too deeply for the chat template", field) from exc
    except Exception as exc:  # the template refused the request (raise_exception) or failed on it: its input's fault
        field = "continue_final_message" if str(exc).startswith("continue_final_message") else blamed
        detail = str(exc) if isinstance(exc, (TemplateError, ValueError)) else f"{type(exc).__name__}: {exc}"
        raise APIError(400, f"{field}: {detail}", field) from exc
