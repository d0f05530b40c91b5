"""Tool calling without a server (server/tools.py, server/tool_stream.py): the "required" schema, finished texts as
messages, streamed deltas that accumulate (as the `openai` client does) to the same message, the server's config, and
tool conversations through a chat template."""

from __future__ import annotations

import copy
import json

import jsonschema
import pytest
from openai.lib.streaming._deltas import accumulate_delta

from looped_spec.engine.chat import render_chat
from looped_spec.server.errors import APIError
from looped_spec.server.protocol import ChatCompletionRequest, ChatTool, FunctionDefinition
from looped_spec.server.tool_stream import ToolCallStream
from looped_spec.server.tools import (
    ToolCallingConfig,
    plan_tools,
    required_calls_schema,
    template_message,
    tool_message,
)

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1}},
    "required": ["city", "days"], "additionalProperties": False}}}  # fmt: skip
NOW = {"type": "function", "function": {"name": "now"}}
AUTO = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")


def request(**fields) -> ChatCompletionRequest:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate_json(json.dumps(body))


def test_required_schema_is_an_array_of_named_calls_and_one_without_parallel_calls():
    tools = [ChatTool.model_validate(WEATHER), ChatTool.model_validate(NOW)]
    schema = required_calls_schema(tools, parallel=True)
    validator = jsonschema.Draft202012Validator(schema)
    weather_call = {"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}
    assert validator.is_valid([{"name": "now", "parameters": {}}, weather_call])
    assert not validator.is_valid([])
    assert not validator.is_valid([{"name": "get_weather", "parameters": {"city": "Oslo"}}])  # a required argument
    assert not validator.is_valid([{"name": "sleep", "parameters": {}}])  # not a tool
    assert not validator.is_valid([{"name": "now", "parameters": {}, "why": 1}])
    single = jsonschema.Draft202012Validator(required_calls_schema(tools, parallel=False))
    assert single.is_valid([{"name": "now", "parameters": {}}])
    assert not single.is_valid([{"name": "now", "parameters": {}}] * 2)


def test_required_schema_resolves_each_tools_refs_inside_its_own_schema():
    """A tool's local refs ("#/$defs/...", "#/definitions/...", "#/properties/...", and "#", its whole schema) mean
    what they mean in the tool's own schema, not in the array of calls; two tools' $defs of one name stay apart; a
    {"$ref": ...} inside a const is a value, left as it is."""
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    move = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}, "via": {"$ref": "#/definitions/point"},
                                         "back": {"$ref": "#/properties/to"}, "tag": {"const": {"$ref": "#"}}},
        "required": ["to"], "$defs": {"point": point}, "definitions": {"point": point}}}}  # fmt: skip
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"n": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["n", "kids"], "additionalProperties": False, "$defs": {"point": {"type": "string"}}}}}  # fmt: skip
    schema = required_calls_schema([ChatTool.model_validate(move), ChatTool.model_validate(tree)], parallel=True)
    validator = jsonschema.Draft202012Validator(schema)
    assert validator.is_valid([{"name": "move", "parameters": {"to": {"x": 1}, "via": {"x": 2}, "back": {"x": 3}}}])
    assert validator.is_valid([{"name": "move", "parameters": {"to": {"x": 1}, "tag": {"$ref": "#"}}}])
    wrong = [{"to": {"y": 1}}, {"to": {"x": 1}, "via": "p"}, {"to": {"x": 1}, "back": 2}, {"to": {"x": 1}, "tag": 1}]
    for bad in wrong:
        assert not validator.is_valid([{"name": "move", "parameters": bad}]), bad
    nested = {"n": 1, "kids": [{"n": 2, "kids": []}]}
    assert validator.is_valid([{"name": "tree", "parameters": nested}])
    # "#" is the tool's schema: a kid is a tree, never the array of calls (as the old layout let it be)
    assert not validator.is_valid([{"name": "tree", "parameters": {"n": 1, "kids": [[{"name": "tree"}]]}}])
    deep = {"type": "object", "properties": {}}
    for _ in range(5000):
        deep = {"type": "object", "properties": {"a": deep}}
    too_deep = {"type": "function", "function": {"name": "deep", "parameters": deep}}
    with pytest.raises(APIError) as refused:
        required_calls_schema([_tool(too_deep)], parallel=True)
    assert refused.value.param == "tools[0].function.parameters"


def _tool(data: dict) -> ChatTool:
    """A ChatTool without validation (a schema nested past pydantic's own recursion limit)."""
    function = FunctionDefinition.model_construct(**data["function"])
    return ChatTool.model_construct(type="function", function=function)


def test_finished_texts_as_messages():
    named = plan_tools(request(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}),
                       ToolCallingConfig())  # fmt: skip
    message = tool_message(named, '{"city": "Oslo", "days": 2}', "stop")
    assert (message.content, message.finish_reason) == (None, "stop")  # OpenAI's and vLLM's for a forced function
    [call] = message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Oslo", "days": 2}')
    assert message.tool_calls[0].id.startswith("chatcmpl-tool-")
    assert tool_message(named, '{"city": "Os', "length").finish_reason == "length"  # cut: the partial arguments

    required = plan_tools(request(tools=[WEATHER, NOW], tool_choice="required"), ToolCallingConfig())
    text = '[{"name": "now", "parameters": {}}, {"name": "get_weather", "parameters": {"city": "Oslo", "days": 2}}]'
    message = tool_message(required, text, "stop")
    assert (message.content, message.finish_reason) == (None, "tool_calls")
    assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
        ("now", {}), ("get_weather", {"city": "Oslo", "days": 2})]  # fmt: skip
    assert len({c.id for c in message.tool_calls}) == 2
    cut = tool_message(required, text[:40], "length")  # the array never closed: no calls, the text as content
    assert (cut.content, cut.tool_calls, cut.finish_reason) == (text[:40], None, "length")

    auto = plan_tools(request(tools=[WEATHER]), AUTO)  # auto: the default with tools
    assert auto.mode == "auto" and auto.decodes_special_tokens
    message = tool_message(auto, 'Ok <tool_call>{"name": "now", "arguments": {}}</tool_call>', "stop")
    assert (message.content, message.finish_reason, message.tool_calls[0].function.name) == ("Ok ", "tool_calls",
                                                                                             "now")  # fmt: skip
    plain = tool_message(auto, "  ", "length")
    assert (plain.content, plain.tool_calls, plain.finish_reason) == ("  ", None, "length")
    two = '<tool_call>{"name": "now"}</tool_call><tool_call>{"name": "get_weather"}</tool_call>'
    assert [c.function.name for c in tool_message(auto, two, "stop").tool_calls] == ["now", "get_weather"]
    single = plan_tools(request(tools=[WEATHER], parallel_tool_calls=False), AUTO)  # vLLM's: the first call only
    assert [c.function.name for c in tool_message(single, two, "stop").tool_calls] == ["now"]


def streamed(plan, text: str, finish_reason: str, step: int) -> tuple[dict, str | None, list[str]]:
    """The message the stream's deltas accumulate to (the openai client's accumulation), its finish reason, and
    the content pieces sent before the last delta."""
    stream, message, early, reason = ToolCallStream(plan), {"role": "assistant", "content": ""}, [], None
    pieces = [text[i : i + step] for i in range(0, len(text), step)] or [""]
    for k, piece in enumerate(pieces):
        finished = k == len(pieces) - 1
        delta, reason = stream.delta(piece, finished, finish_reason if finished else None)
        assert (reason is None) != finished
        if delta is not None:
            dumped = json.loads(delta.model_dump_json())
            if not finished and dumped.get("content"):
                early.append(dumped["content"])
            message = accumulate_delta(message, dumped)
    return message, reason, early


def as_dict(message) -> dict:
    calls = [{"name": c.function.name, "arguments": c.function.arguments} for c in message.tool_calls or []]
    return {"content": message.content or "", "calls": calls}


def accumulated(message: dict) -> dict:
    calls = [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]}
             for c in message.get("tool_calls") or []]  # fmt: skip
    assert [c["index"] for c in message.get("tool_calls") or []] == list(range(len(calls)))
    assert all(c["id"].startswith("chatcmpl-tool-") and c["type"] == "function" for c in message.get("tool_calls")
               or [])  # fmt: skip
    return {"content": message.get("content") or "", "calls": calls}


@pytest.mark.parametrize("step", [1, 3, 1000])
@pytest.mark.parametrize(
    ("choice", "text", "finish_reason"),
    [
        ("none", "plain <tool_call> text", "stop"),
        ({"type": "function", "function": {"name": "get_weather"}}, '{"city": "Oslo", "days": 2}', "stop"),
        ({"type": "function", "function": {"name": "get_weather"}}, "", "length"),
        ("required", '[{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}]', "stop"),
        ("required", '[{"name": "now", "par', "length"),
        ("auto", 'I will. <tool_call>{"name": "now", "arguments": {}}</tool_call>\n<tool_call>{"name": '
                 '"get_weather", "arguments": {"city": "<Oslo>", "days": 1}}</tool_call> Bye <', "stop"),
        ("auto", '\n<tool_call>{"name": "now", "arguments": {}}</tool_call>\n', "stop"),
        ("auto", 'Text <tool_call>{"name": broken}</tool_call> more', "stop"),
        ("auto", "Just text < and more <tool_", "length"),
    ],
)  # fmt: skip
def test_streamed_deltas_accumulate_to_the_finished_message(choice, text, finish_reason, step):
    plan = plan_tools(request(tools=[WEATHER, NOW], tool_choice=choice), AUTO)
    whole = tool_message(plan, text, finish_reason)
    message, reason, early = streamed(plan, text, finish_reason, step)
    assert accumulated(message) == as_dict(whole) and reason == whole.finish_reason
    assert all("<tool_call>" not in piece for piece in early) or plan.mode == "none"  # no call text as content
    if plan.mode == "auto" and step == 1 and whole.content and whole.tool_calls:
        assert early  # content before the first call is streamed before the output ends


def test_server_config_needs_a_known_parser():
    assert ToolCallingConfig().auto_parser() is None
    with pytest.raises(ValueError, match="--tool-call-parser hermes: only with --enable-auto-tool-choice"):
        ToolCallingConfig(tool_call_parser="hermes")  # a parser alone would be ignored
    with pytest.raises(ValueError, match="--enable-auto-tool-choice needs --tool-call-parser"):
        ToolCallingConfig(enable_auto_tool_choice=True)
    with pytest.raises(ValueError, match="--tool-call-parser 'json': unknown; known: hermes"):
        ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="json")


# a template that shows what tool-use templates read: the tools, an assistant's calls (arguments as a dict), a tool
# message's call id
TEMPLATE = (
    "{% for t in tools or [] %}[tool {{ t.function.name }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}[call {{ c.id }} {{ c.function.name }}"
    "{% for k, v in c.function.arguments.items() %} {{ k }}={{ v }}{% endfor %}]{% endfor %}"
    "{% if m.tool_call_id %}[answers {{ m.tool_call_id }}]{% endif %}{% endfor %}"
)


def test_a_tool_conversation_reaches_the_template():
    from looped_spec.engine.inputs import load_tokenizer
    from looped_spec.models import shipped_models

    tokenizer = copy.copy(load_tokenizer(shipped_models()["tiny-ouro"]))
    tokenizer.chat_template = TEMPLATE
    body = request(tools=[WEATHER], tool_choice="none", messages=[
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "c1", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Oslo", "days": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])  # fmt: skip
    plan = plan_tools(body, ToolCallingConfig())
    messages = [template_message(m, i) for i, m in enumerate(body.messages)]
    rendered = render_chat(tokenizer, messages, add_generation_prompt=False, tools=plan.template_tools)
    assert rendered == ("[tool get_weather]<user>weather?<assistant>[call c1 get_weather city=Oslo days=2]"
                        "<tool>sunny[answers c1]")  # fmt: skip
    bad = request(messages=[{"role": "assistant", "tool_calls": [{"id": "c1", "type": "function", "function": {
        "name": "f", "arguments": "{oops"}}]}])  # fmt: skip
    with pytest.raises(APIError) as refused:
        template_message(bad.messages[0], 0)
    assert refused.value.param == "messages[0].tool_calls[0].function.arguments"
