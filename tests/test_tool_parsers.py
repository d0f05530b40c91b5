"""Tool-call parsers on text (server/tool_parsers.py): the hermes format's calls, content around them, malformed calls
left as content, and the content a stream may send before the output ends."""

from __future__ import annotations

import json

import pytest

from looped_spec.server.tool_parsers import TOOL_PARSERS, HermesToolParser, ParsedCall, ParsedOutput, tool_parser

hermes = HermesToolParser()


def call_text(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_one_call_with_text_around_it():
    text = "Let me look.\n" + call_text("get_weather", {"city": "Paris", "days": 2}) + "\nOne moment."
    parsed = hermes.parse(text)
    assert parsed.calls == [ParsedCall("get_weather", '{"city": "Paris", "days": 2}')]
    assert parsed.content == "Let me look.\n\nOne moment."


def test_several_calls_in_order_and_whitespace_between_is_no_content():
    text = call_text("a", {"x": 1}) + "\n" + call_text("b", {}) + "\n" + call_text("a", {"x": [1, {"y": "é"}]})
    parsed = hermes.parse(text)
    assert [c.name for c in parsed.calls] == ["a", "b", "a"]
    assert [json.loads(c.arguments) for c in parsed.calls] == [{"x": 1}, {}, {"x": [1, {"y": "é"}]}]
    assert "é" in parsed.calls[2].arguments  # written as the model's text, not \\u escapes (vLLM's)
    assert parsed.content is None


def test_no_calls_is_all_content():
    assert hermes.parse("Paris is sunny.") == ParsedOutput("Paris is sunny.")
    assert hermes.parse("  \n") == ParsedOutput(None)
    assert hermes.parse("") == ParsedOutput(None)


@pytest.mark.parametrize(
    "bad_call",
    [
        '<tool_call>{"name": "f", "arguments": {"x": 1}</tool_call>',  # unbalanced JSON
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',  # no name
        '<tool_call>{"name": 3, "arguments": {}}</tool_call>',  # a name that is not a string
        '<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>',  # arguments that are not an object
        '<tool_call>["f", {}]</tool_call>',
    ],
)
def test_a_malformed_call_leaves_the_whole_text_as_content(bad_call):
    text = "Sure. " + call_text("good", {"y": 2}) + bad_call + " done"
    assert hermes.parse(text) == ParsedOutput(text)


def test_missing_arguments_are_an_empty_object_and_an_unclosed_last_call_is_parsed():
    assert hermes.parse('<tool_call>{"name": "now"}</tool_call>').calls == [ParsedCall("now", "{}")]
    # some models write the arguments under "parameters": they are kept, not dropped for {}
    spelled = '<tool_call>{"name": "f", "parameters": {"a": 1}}</tool_call>'
    assert hermes.parse(spelled).calls == [ParsedCall("f", '{"a": 1}')]
    both = '<tool_call>{"name": "f", "arguments": {"a": 1}, "parameters": {"b": 2}}</tool_call>'
    assert hermes.parse(both).calls == [ParsedCall("f", '{"a": 1}')]  # "arguments" wins
    unclosed = 'Hi <tool_call>{"name": "f", "arguments": {"a": 1}}\n'  # the model ended right after the JSON
    assert hermes.parse(unclosed) == ParsedOutput("Hi ", [ParsedCall("f", '{"a": 1}')])
    cut = 'Hi <tool_call>{"name": "f", "argu'  # max_tokens cut the call: not a call, all content
    assert hermes.parse(cut) == ParsedOutput(cut)


def test_certain_content_stops_where_a_call_may_begin():
    assert hermes.certain_content("Hello there") == "Hello there"
    assert hermes.certain_content("Hello <tool_call>{") == "Hello "
    assert hermes.certain_content("Hello <tool_c") == "Hello "  # may still become a start tag
    assert hermes.certain_content("Hello <") == "Hello "
    assert hermes.certain_content("Hello <b>") == "Hello <b>"  # cannot become one
    assert hermes.certain_content("<tool_call>") == ""
    # the certain content is always where the parsed content of the whole text starts
    whole = "Hello <b> " + call_text("f", {}) + " bye"
    for end in range(len(whole) + 1):
        certain = hermes.certain_content(whole[:end])
        assert whole.startswith(certain) and (hermes.parse(whole).content or "").startswith(certain), end


def test_parsers_by_name():
    assert isinstance(tool_parser("hermes"), HermesToolParser)
    assert sorted(TOOL_PARSERS) == ["hermes"]
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; known: hermes"):
        tool_parser("mistral")
