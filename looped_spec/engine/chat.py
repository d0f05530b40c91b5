"""Chat conversations as prompts: rendered by the tokenizer's chat template (or one given) through transformers'
`apply_chat_template`, shared by the offline `LoopedSpecEngine.chat` and the server's chat completions."""

from __future__ import annotations

import inspect
import json
from functools import lru_cache
from typing import Any

from looped_spec.engine.inputs import check_text


class NoChatTemplateError(ValueError):
    """The model's tokenizer has no chat template and none was given: messages cannot be formatted."""


@lru_cache(maxsize=1)
def rendering_parameters() -> frozenset[str]:
    """The names transformers' renderer takes itself (`add_generation_prompt`, `tokenize`, `tools`, `return_dict`,
    ...): as template variables they would collide with how the prompt is rendered, or change what it returns."""
    from transformers import PreTrainedTokenizerBase
    from transformers.utils.chat_template_utils import render_jinja_template

    kinds = (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    names = {"messages"}
    for function in (PreTrainedTokenizerBase.apply_chat_template, render_jinja_template):
        names |= {p.name for p in inspect.signature(function).parameters.values() if p.kind not in kinds}
    return frozenset(names - {"self"})


#: why a model without tokenizer files cannot chat, whatever template it is given
NO_TOKENIZER_FOR_CHAT = (
    "the model has no tokenizer (no tokenizer.json or tokenizer_config.json in its folder) to encode a chat's text, "
    "with any chat template: send a plain prompt of token ids"
)


def render_chat(
    tokenizer,
    messages: list[dict],
    add_generation_prompt: bool = True,
    tools: list[dict] | None = None,
    chat_template: str | None = None,
    continue_final_message: bool = False,
    template_kwargs: dict | None = None,
) -> str:
    """The prompt text for `messages`, rendered by transformers' `apply_chat_template` with `chat_template` (None: the
    tokenizer's own); `tools` (OpenAI's shape) reach the template as its `tools` variable (a template that does not
    use them ignores them), `template_kwargs` as variables of their own; `continue_final_message` leaves the last
    message open (the text ends with its content)."""
    if tokenizer is None:  # a template would not help: its text could not be encoded
        raise NoChatTemplateError(NO_TOKENIZER_FOR_CHAT)
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplateError(
            "this model's tokenizer has no chat_template: give one (chat_template=, serve --chat-template) or send a "
            "plain prompt"
        )
    return tokenizer.apply_chat_template(
        messages,
        tools=tools,
        chat_template=chat_template,
        tokenize=False,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **(template_kwargs or {}),
    )


def conversations(messages: Any) -> list[list[dict]]:
    """One conversation (a list of message dicts) or several (a list of such lists), as a list of conversations of
    messages as templates take them (`template_message`)."""
    if isinstance(messages, list) and messages and all(isinstance(m, dict) for m in messages):
        return [[template_message(m, f"messages[{j}]") for j, m in enumerate(messages)]]
    if isinstance(messages, list) and messages and all(isinstance(c, list) and c for c in messages):
        for i, conversation in enumerate(messages):
            for j, message in enumerate(conversation):
                if not isinstance(message, dict):
                    raise TypeError(f"messages[{i}][{j}]: a message is a dict, got {type(message).__name__}")
        return [[template_message(m, f"messages[{i}][{j}]") for j, m in enumerate(c)] for i, c in enumerate(messages)]
    raise TypeError("messages: one conversation (a non-empty list of message dicts, {'role': ..., 'content': ...}) or "
                    "a list of them")  # fmt: skip


def template_message(message: dict, where: str) -> dict:
    """`message` as the server (server/tools.py's `template_message`) and vLLM hand it to a chat template (a copy; the
    caller's dict is left as it was): content given as OpenAI's parts (`[{"type": "text", "text": ...}, ...]`) becomes
    their texts one a line (vLLM's "string" content format), a null or missing content "" (an assistant's message
    that is all tool calls); an assistant's tool calls carry their `arguments` as a dict, not JSON text
    (transformers' documented form, which tool-use templates iterate); an assistant's reasoning reaches the template
    as both `reasoning` and `reasoning_content` (its former name, which most thinking models' templates read)."""
    out = {**message, "content": _text(message.get("content"), where)}
    calls = message.get("tool_calls")
    if message.get("role") == "assistant" and isinstance(calls, list):
        out["tool_calls"] = [_parsed_arguments(call, f"{where}.tool_calls[{j}]") for j, call in enumerate(calls)]
    reasoning = message.get("reasoning")
    reasoning = reasoning if reasoning is not None else message.get("reasoning_content")
    if reasoning is not None and message.get("role") == "assistant":  # under both names, as vLLM passes it
        out["reasoning"] = out["reasoning_content"] = reasoning
    return out


def _text(content: Any, where: str) -> Any:
    """A message's content as the template's text: parts joined one a line, None as ""."""
    if content is None:
        return ""
    if isinstance(content, str):
        check_text(content, f"{where}.content")  # a lone surrogate, which no tokenizer encodes
    if not isinstance(content, list):
        return content
    texts = []
    for k, part in enumerate(content):
        if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise ValueError(f"{where}.content[{k}]: only text parts ({{'type': 'text', 'text': ...}}) are supported, "
                             f"got {kind!r}")  # fmt: skip
        check_text(part["text"], f"{where}.content[{k}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def _parsed_arguments(call: Any, where: str) -> Any:
    """A tool call with its function's JSON `arguments` text parsed (empty: {}); arguments already a dict (or a call
    of another shape, for the template to judge) are left as they are."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict):
        return call
    arguments = function.get("arguments")
    if isinstance(arguments, (dict, list)):
        return call
    if arguments is not None and not isinstance(arguments, str):
        raise ValueError(f"{where}.function.arguments: JSON text or a dict, got {type(arguments).__name__}")
    parsed = tool_call_arguments(arguments, f"{where}.function.arguments")
    return {**call, "function": {**function, "arguments": parsed}}


def tool_call_arguments(arguments: str | None, where: str) -> Any:
    """A tool call's JSON `arguments` text as templates take it (none or empty: {}); a ValueError naming `where` for
    text that is not JSON (offline chat and the server alike)."""
    try:
        return json.loads(arguments) if arguments else {}
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from None
    except RecursionError:
        raise ValueError(f"{where}: nested too deeply") from None


def chat_prompt(
    tokenizer,
    conversation: list[dict],
    where: str,
    *,
    chat_template: str | None = None,
    template_kwargs: dict | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    tools: list[dict] | None = None,
) -> tuple[str, list[int]]:
    """A conversation's prompt as the template renders it, and its token ids (the template writes its own special
    tokens: none are added); a template's failure is a ValueError naming `where` (the conversation) or
    `chat_template`."""
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message=True needs add_generation_prompt=False (a new turn cannot also "
                         "continue the last message)")  # fmt: skip
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise TypeError(f"chat_template_kwargs: a dict of template variables, got {type(template_kwargs).__name__}")
    if tools is not None and not isinstance(tools, list):
        raise TypeError(f"tools: a list of tools (OpenAI's shape), got {type(tools).__name__}")
    for name in template_kwargs or {}:
        if name in rendering_parameters():
            raise ValueError(f"chat_template_kwargs[{name!r}]: a rendering parameter, not a template variable (pass "
                             "chat()'s own argument where there is one)")  # fmt: skip
    try:
        text = render_chat(tokenizer, conversation, add_generation_prompt, tools, chat_template,
                           continue_final_message, template_kwargs)  # fmt: skip
    except NoChatTemplateError:
        raise
    except Exception as exc:  # the template refused the conversation (raise_exception) or failed on it
        blamed = "chat_template" if chat_template is not None else where
        raise ValueError(f"{blamed}: the chat template failed on {where}: {type(exc).__name__}: {exc}") from exc
    check_text(text, where)  # what the template added (a name, a variable) may hold a lone surrogate too
    return text, list(tokenizer.encode(text, add_special_tokens=False))
