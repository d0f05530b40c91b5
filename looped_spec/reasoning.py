"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model (Ouro-Thinking, DeepSeek-R1, Qwen3, ...) writes
its reasoning between `<think>` and `</think>` before its answer; a chat reply carries the two apart, the reasoning
as `message.reasoning` (streamed as `delta.reasoning`), the answer as `message.content`.

Two rules, by where the reasoning may start:

- `deepseek_r1`: the chat template may already have opened `<think>` in the prompt, so everything before `</think>`
  is reasoning, `<think>` or not at the start; a reply that never closes it is all reasoning (content null).
- `qwen3`: the model opens `<think>` itself; a reply that does not start with it (thinking switched off, e.g.
  `chat_template_kwargs: {"enable_thinking": false}`) is all content; one that opens it and never closes it is all
  reasoning, as under `deepseek_r1`.

Whitespace before `<think>` is dropped; the text after `</think>` is the content as written. Streaming sends the same
split as it becomes certain (a piece that may be the start of a tag waits for the next), so the deltas add up to
the whole reply's fields.
"""

from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"


@dataclass(frozen=True)
class Split:
    """A reply's text, or the certain part of one still being generated, taken apart."""

    reasoning: str | None  # None: the reply has no reasoning
    content: str | None  # None: no content (yet)


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    opened_by_template: bool  # the reasoning may start without <think> (deepseek_r1)

    def split(self, text: str, finished: bool = True) -> Split:
        """The reasoning and content of `text`; while the reply is still being generated (`finished` False), only
        what no later text can change (a tail that may begin a tag is held back)."""
        body = text.lstrip()
        opened = body.startswith(START)
        if not opened and not finished and not body and not self.opened_by_template:
            return Split(None, None)  # only whitespace so far: <think> may still come
        if not opened and not finished and START.startswith(body) and body:
            return Split(None, None)  # the start of <think>, perhaps
        if opened:
            body = body[len(START) :]
        elif not self.opened_by_template:
            return Split(None, text)  # qwen3 without <think>: all content
        end = body.find(END)
        if end >= 0:
            return Split(body[:end], body[end + len(END) :])
        if finished:
            return Split(body, None)
        return Split(body[: len(body) - _partial_tag(body, END)], None)


def _partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for keep in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-keep:]):
            return keep
    return 0


#: the parsers `--reasoning-parser` may name
REASONING_PARSERS = {"deepseek_r1": ReasoningParser("deepseek_r1", True), "qwen3": ReasoningParser("qwen3", False)}


def reasoning_parser(name: str) -> ReasoningParser:
    """The parser called `name`; ValueError listing the known ones for any other name."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser {name!r}: unknown; known: {', '.join(sorted(REASONING_PARSERS))}")
    return REASONING_PARSERS[name]


class ReasoningStream:
    """One streamed choice's reasoning and content pieces: feed the reply's new text as it comes; `content` pieces go
    on to the tool-call stream (server/tool_stream.py), which sees the content alone."""

    def __init__(self, parser: ReasoningParser) -> None:
        self.parser = parser
        self.text = ""
        self.reasoning_sent = 0
        self.content_sent = 0

    def feed(self, new_text: str, finished: bool) -> tuple[str, str]:
        """(new reasoning, new content) now certain."""
        self.text += new_text
        split = self.parser.split(self.text, finished)
        reasoning = (split.reasoning or "")[self.reasoning_sent :]
        content = (split.content or "")[self.content_sent :]
        self.reasoning_sent += len(reasoning)
        self.content_sent += len(content)
        return reasoning, content
