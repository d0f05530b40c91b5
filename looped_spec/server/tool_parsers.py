"""Tool-call parsers for `tool_choice: "auto"`: find the calls a model wrote in its own format in the generated text.

A server parses with the one `--tool-call-parser` names (with `--enable-auto-tool-choice`, as vLLM's flags). A parser
works on text only, after generation: the model is not constrained, so text that does not parse stays the message's
content (no calls, no error).
"""

from __future__ import annotations

import json
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar


@dataclass(frozen=True)
class ParsedCall:
    """One call as the model wrote it: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


@dataclass(frozen=True)
class ParsedOutput:
    """A generated text split into the message's content (None when there is none) and the calls found in it."""

    content: str | None
    calls: list[ParsedCall] = field(default_factory=list)


class ToolParser(ABC):
    """Splits a model's text into content and tool calls."""

    name: ClassVar[str]

    @abstractmethod
    def parse(self, text: str) -> ParsedOutput:
        """The content and calls of a whole generated text; text that does not parse is all content."""

    @abstractmethod
    def certain_content(self, text: str) -> str:
        """The longest prefix of a text still being generated that is content whatever follows: a stream sends it
        as content before the output ends (the rest may turn out to be a call)."""


def content_or_none(text: str) -> str | None:
    """Whitespace around calls is no content: a message whose text is all calls has content None."""
    return text if text.strip() else None


class HermesToolParser(ToolParser):
    """Hermes 2 Pro's format (also Qwen 2.5's and others'): each call is `<tool_call>{"name": ..., "arguments": {...}}
    </tool_call>`; text outside the tags is content. A last call whose closing tag never came (the model ended with
    it, or max_tokens cut it) is parsed up to the end of the text. Any call that is not a JSON object with a string
    "name" and an object "arguments" (or "parameters"; neither: {}) leaves the whole text as content, as vLLM's parser
    does."""

    name = "hermes"
    START = "<tool_call>"
    END = "</tool_call>"
    _CALL = re.compile(re.escape(START) + r"(.*?)(?:" + re.escape(END) + r"|\Z)", re.DOTALL)

    def parse(self, text: str) -> ParsedOutput:
        calls, outside, last = [], [], 0
        for match in self._CALL.finditer(text):
            call = self._call(match.group(1))
            if call is None:
                return ParsedOutput(content_or_none(text))
            calls.append(call)
            outside.append(text[last : match.start()])
            last = match.end()
        if not calls:
            return ParsedOutput(content_or_none(text))
        outside.append(text[last:])
        return ParsedOutput(content_or_none("".join(outside)), calls)

    def certain_content(self, text: str) -> str:
        start = text.find(self.START)
        if start >= 0:
            return text[:start]
        # the text may end with the first characters of a start tag
        for keep in range(min(len(self.START) - 1, len(text)), 0, -1):
            if self.START.startswith(text[-keep:]):
                return text[:-keep]
        return text

    @staticmethod
    def _call(body: str) -> ParsedCall | None:
        try:
            value = json.loads(body)
        except json.JSONDecodeError:
            return None
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        # "parameters": the name some models (Llama 3's style) write the arguments under
        arguments = value["arguments"] if "arguments" in value else value.get("parameters", {})
        if not isinstance(arguments, dict):
            return None
        return ParsedCall(value["name"], json.dumps(arguments, ensure_ascii=False))


#: the parsers `--tool-call-parser` may name
TOOL_PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesToolParser,)}


def tool_parser(name: str) -> ToolParser:
    """The parser called `name`; ValueError listing the known ones for any other name."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(sorted(TOOL_PARSERS))}")
    return TOOL_PARSERS[name]()
