"""Tool calling on /v1/chat/completions, as vLLM does it: what each `tool_choice` asks of generation and how a
generated text becomes the message's content and tool calls.

- "none": plain generation (the tools still reach the chat template, vLLM's default).
- a named function: the output is constrained to the function's parameters schema; the text is the call's arguments.
- "required": the output is constrained to a JSON array of `{"name": <a tool's name>, "parameters": <its schema>}`
  (one item at most without parallel tool calls); each item is a call.
- "auto": free generation; the server's tool-call parser (server/tool_parsers.py) finds calls in the text.

Constrained calls are exact (the sampler masks tokens, structured_output.py); parsed ones are as good as the model.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, model_validator

from looped_spec.engine.chat import tool_call_arguments
from looped_spec.server.errors import APIError
from looped_spec.server.protocol import ChatCompletionRequest, ChatTool, FunctionCall, NamedToolChoice, ToolCall
from looped_spec.server.tool_parsers import TOOL_PARSERS, ParsedCall, ToolParser, tool_parser
from looped_spec.structured_output import StructuredOutputs

ToolMode = Literal["none", "auto", "required", "named"]
#: a function without parameters takes an empty object (vLLM's default schema)
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def new_tool_call_id() -> str:
    """A fresh call id, vLLM's format."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class ToolCallingConfig(BaseModel):
    """How a server treats `tool_choice: "auto"` (flags `--enable-auto-tool-choice --tool-call-parser NAME`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enable_auto_tool_choice: bool = False
    tool_call_parser: str | None = None

    @model_validator(mode="after")
    def _known_parser(self) -> ToolCallingConfig:
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                             f"{', '.join(sorted(TOOL_PARSERS))})")  # fmt: skip
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"--tool-call-parser {self.tool_call_parser!r}: unknown; known: "
                             f"{', '.join(sorted(TOOL_PARSERS))}")  # fmt: skip
        if self.tool_call_parser is not None and not self.enable_auto_tool_choice:
            # the parser reads only tool_choice "auto"'s calls ("required" and a named function are constrained
            # JSON): alone it would be ignored
            raise ValueError(f"--tool-call-parser {self.tool_call_parser}: only with --enable-auto-tool-choice (the "
                             'parser finds tool_choice "auto"\'s calls; "required" and a named function need neither '
                             "flag)")  # fmt: skip
        return self

    def auto_parser(self) -> ToolParser | None:
        """The parser `"auto"` runs, or None when the server was not started with auto tool choice."""
        return tool_parser(self.tool_call_parser) if self.enable_auto_tool_choice else None


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tools ask: the grammar its output follows (None: free), where a grammar that does not
    compile is reported, the tools for the chat template, and how the text becomes a message."""

    mode: ToolMode
    template_tools: list[dict] | None = None
    grammar: StructuredOutputs | None = None
    grammar_field: str = "tools"
    function_name: str | None = None  # "named": the function called
    parser: ToolParser | None = None  # "auto": the server's parser
    tools: tuple[ChatTool, ...] = ()
    parallel: bool = True  # parallel_tool_calls: False keeps a parsed answer's first call only (vLLM's)

    @property
    def decodes_special_tokens(self) -> bool:
        """A parser reads the model's own call tags, which a tokenizer may hold as special tokens (vLLM's hermes
        parser likewise turns skip_special_tokens off)."""
        return self.mode == "auto"

    def generation_fields(self, body: ChatCompletionRequest) -> ChatCompletionRequest:
        """The request's sampling fields as generation runs them: a forced call's grammar in place of the request's
        (refused beside it, `refuse_other_grammar`), special tokens kept for a parser."""
        update: dict[str, Any] = {}
        if self.grammar is not None:
            update.update(structured_outputs=self.grammar, response_format=None)
        if self.decodes_special_tokens:
            update["skip_special_tokens"] = False
        return body.model_copy(update=update) if update else body

    def each_tool_grammar(self) -> list[tuple[str, StructuredOutputs]]:
        """("tools[i].function.parameters", that schema's grammar) for every tool: which one fails to compile when
        the combined "required" grammar does."""
        return [(f"tools[{i}].function.parameters", StructuredOutputs(json=parameters_schema(tool)))
                for i, tool in enumerate(self.tools)]  # fmt: skip


def parameters_schema(tool: ChatTool) -> dict[str, Any]:
    return tool.function.parameters if tool.function.parameters is not None else NO_PARAMETERS


def plan_tools(body: ChatCompletionRequest, config: ToolCallingConfig) -> ToolPlan:
    """The request's tool plan; a 400 naming the field for tools or a tool_choice that cannot be served."""
    tools = list(body.tools or [])
    seen: dict[str, int] = {}
    for i, tool in enumerate(tools):
        if tool.function.name in seen:
            field = f"tools[{i}].function.name"
            raise APIError(400, f"{field}: {tool.function.name!r} is also tools[{seen[tool.function.name]}]'s name; "
                           "tool names must be unique", field)  # fmt: skip
        seen[tool.function.name] = i
    choice = body.chosen_tool_mode()
    template_tools = [tool.model_dump(exclude_none=True) for tool in tools] or None
    if choice == "none":
        return ToolPlan("none", template_tools)
    if not tools:
        raise APIError(400, f"tool_choice: {describe(choice)} needs tools (give a non-empty tools list or leave "
                       "tool_choice out)", "tool_choice")  # fmt: skip
    if choice == "required" or isinstance(choice, NamedToolChoice):
        refuse_other_grammar(body, choice)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in seen:
            raise APIError(400, f"tool_choice.function.name: {name!r} is not among the tools "
                           f"({', '.join(repr(n) for n in seen)})", "tool_choice.function.name")  # fmt: skip
        index = seen[name]
        grammar = StructuredOutputs(json=parameters_schema(tools[index]))
        return ToolPlan("named", template_tools, grammar, f"tools[{index}].function.parameters", name,
                        tools=tuple(tools))  # fmt: skip
    if choice == "required":
        grammar = StructuredOutputs(json=required_calls_schema(tools, body.parallel_tool_calls))
        return ToolPlan("required", template_tools, grammar, "tools", tools=tuple(tools))
    parser = config.auto_parser()
    if parser is None:
        default = " (the default when tools are given)" if body.tool_choice is None else ""
        raise APIError(400, f'tool_choice: "auto"{default} needs a server started with --enable-auto-tool-choice '
                       '--tool-call-parser NAME; send tool_choice "none", "required" or a named function instead',
                       "tool_choice")  # fmt: skip
    return ToolPlan("auto", template_tools, parser=parser, tools=tuple(tools), parallel=body.parallel_tool_calls)


def describe(choice: str | NamedToolChoice) -> str:
    return f"function {choice.function.name!r}" if isinstance(choice, NamedToolChoice) else json.dumps(choice)


def refuse_other_grammar(body: ChatCompletionRequest, choice: str | NamedToolChoice) -> None:
    """A forced call's grammar is the tools': a second grammar from the request cannot also hold."""
    field = None
    if body.structured_outputs is not None:
        field = "structured_outputs"
    elif body.response_format is not None and body.response_format.type != "text":
        field = "response_format"
    if field is not None:
        raise APIError(400, f"{field}: tool_choice {describe(choice)} constrains the output to a tool call; a second "
                       'grammar cannot also apply (use tool_choice "auto" or "none", or drop it)', field)  # fmt: skip


def required_calls_schema(tools: list[ChatTool], parallel: bool) -> dict[str, Any]:
    """The JSON schema of `"required"`'s output: an array of calls, each `{"name": one tool's name, "parameters":
    that tool's arguments}` (anyOf over the tools; vLLM's). Each tool's whole schema moves under `$defs` as
    `tool_<i>`, its local `$ref`s ("#", "#/properties/...", "#/$defs/...", "#/definitions/...") rewritten to point
    inside that copy: written for the tool's schema as the document root, they would otherwise resolve against this
    array (a recursive "#" would nest calls in the arguments)."""
    defs: dict[str, Any] = {}
    variants = []
    for i, tool in enumerate(tools):
        key = f"tool_{i}"
        try:
            defs[key] = relocated_refs(parameters_schema(tool), f"#/$defs/{key}")
        except RecursionError as exc:
            field = f"tools[{i}].function.parameters"
            raise APIError(400, f"{field}: nested too deeply", field) from exc
        variants.append({
            "type": "object",
            "properties": {"name": {"const": tool.function.name}, "parameters": {"$ref": f"#/$defs/{key}"}},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        })  # fmt: skip
    schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": variants}, "$defs": defs}
    if not parallel:
        schema["maxItems"] = 1
    return schema


#: keywords whose values are data, not schemas: a {"$ref": ...} inside them is a value to keep as it is
_DATA_KEYWORDS = frozenset({"const", "enum", "default", "examples"})


def relocated_refs(schema: Any, root: str) -> Any:
    """A copy of `schema` whose local `$ref`s ("#..."), written against the schema as a document root, point into
    the schema placed at JSON pointer `root` ("#/$defs/tool_0") of another document. Other refs stay."""
    if isinstance(schema, list):
        return [relocated_refs(item, root) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "$ref" and isinstance(value, str) and value.startswith("#"):
            out[key] = root + value[1:]
        elif key in _DATA_KEYWORDS:
            out[key] = value
        else:
            out[key] = relocated_refs(value, root)
    return out


@dataclass(frozen=True)
class ToolMessage:
    """A choice's message as the client gets it, and its finish reason."""

    content: str | None
    tool_calls: list[ToolCall] | None
    finish_reason: str | None


def tool_call(call: ParsedCall) -> ToolCall:
    return ToolCall(id=new_tool_call_id(), function=FunctionCall(name=call.name, arguments=call.arguments))


def required_calls(text: str) -> list[ParsedCall] | None:
    """The calls of a "required" output (the grammar's array), or None when it is incomplete (max_tokens or a stop
    string cut it)."""
    try:
        items = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(items, list) or not items:
        return None
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str) or "parameters" not in item:
            return None
        calls.append(ParsedCall(item["name"], json.dumps(item["parameters"], ensure_ascii=False)))
    return calls


def tool_message(plan: ToolPlan, text: str, finish_reason: str | None) -> ToolMessage:
    """A choice's finished text as its message.

    A message of calls only has content None (OpenAI's null; vLLM writes ""). named: one call whose arguments are the
    text, the finish reason as generated ("stop", as OpenAI and vLLM say for a forced function). required: the
    array's calls, "tool_calls". auto: the parser's content and calls, "tool_calls" when it found any. A forced output
    cut before its grammar completed (max_tokens: "length", a stop string or token: "stop"): named keeps its partial
    arguments; required, whose array does not parse, returns the text as content."""
    if plan.mode == "named":
        call = ParsedCall(plan.function_name, text)
        return ToolMessage(None, [tool_call(call)], finish_reason)
    if plan.mode == "required":
        calls = required_calls(text)
        if calls is None:
            return ToolMessage(text, None, finish_reason)
        return ToolMessage(None, [tool_call(c) for c in calls], "tool_calls")
    if plan.mode == "auto":
        parsed = plan.parser.parse(text)
        if parsed.calls:
            calls = parsed.calls if plan.parallel else parsed.calls[:1]
            return ToolMessage(parsed.content, [tool_call(c) for c in calls], "tool_calls")
        return ToolMessage(parsed.content if parsed.content is not None else text, None, finish_reason)
    return ToolMessage(text, None, finish_reason)


def template_message(message: Any, index: int) -> dict[str, Any]:
    """A request message as chat templates take it. An assistant's tool calls carry their arguments as a dict, not
    JSON text: transformers' documented form, which tool-use templates iterate (vLLM converts them too)."""
    out: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.tool_calls is not None:
        calls = []
        for j, call in enumerate(message.tool_calls):
            field = f"messages[{index}].tool_calls[{j}].function.arguments"
            try:
                arguments = tool_call_arguments(call.function.arguments, field)
            except ValueError as exc:
                raise APIError(400, str(exc), field) from exc
            calls.append({"id": call.id, "type": call.type,
                          "function": {"name": call.function.name, "arguments": arguments}})  # fmt: skip
        out["tool_calls"] = calls
    reasoning = message.reasoning if message.reasoning is not None else message.reasoning_content
    if reasoning is not None:  # under both names, as vLLM passes it: templates read either
        out["reasoning"] = out["reasoning_content"] = reasoning  # reasoning_content: Qwen3's, most thinking models'
    if message.tool_call_id is not None:
        out["tool_call_id"] = message.tool_call_id
    if message.name is not None:  # on any role, as vLLM passes it (a tool message's: the function it answers)
        out["name"] = message.name
    return out
