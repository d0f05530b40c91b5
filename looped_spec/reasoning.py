"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model (Ouro-Thinking, DeepSeek-R1, Qwen3, ...) writes
its reasoning between `<think>` and `</think>` before its answer; a chat reply carries the two apart, the reasoning
as `message.reasoning` (streamed as `delta.reasoning`), the answer as `message.content`.

Two rules, by where the reasoning may start:

- `deepseek_r1`: the chat template may already have opened `<think>` in the prompt, so everything before `</think>`
  is reasoning, `<think>` or not at the start; a reply that never closes it is all reasoning (content null).
- `qwen3`: the model opens `<think>` itself; a reply that does not start with it (thinking switched off, e.g.
  `chat_template_kwargs: {"enable_thinking": false}`) is all content; one that opens it and never closes it is all
  reasoning, as under `deepseek_r1`.

Whitespace before `<think>` is dropped; otherwise the reasoning (a `deepseek_r1` reply without `<think>` from its
first character) and the content after `</think>` are as written. Streaming sends the same
split as it becomes certain (a piece that may be the start of a tag waits for the next), so the deltas add up to
the whole reply's fields.

A request's grammar (structured outputs, a forced tool call) starts where the reasoning ends: `grammar_gate` gives the
token ids of `</think>` the engine opens it after (`SamplingParams.reasoning_end_token_ids`, structured_output.py), or
none under `qwen3` when the prompt itself closed the reasoning. The engine's `reasoning_parser` option and the server's
`--reasoning-parser` both use it; this module needs none of the server's dependencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

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
        if not finished and START.startswith(body):  # only whitespace so far, or the start of <think>: it may open
            return Split(None, None)
        if body.startswith(START):
            body = body[len(START) :]  # the whitespace before <think> is no part of the reasoning
        elif self.opened_by_template:
            body = text  # deepseek_r1: the reasoning as written, from the reply's first character
        else:
            return Split(None, text)  # qwen3 without <think>: all content
        end = body.find(END)
        if end >= 0:
            return Split(body[:end], body[end + len(END) :])
        if finished:
            return Split(body, None)
        return Split(body[: len(body) - _partial_tag(body, END)], None)

    def grammar_gate(self, tokenizer: Any, vocab_size: int, prompt: Sequence[int] = ()) -> list[int]:
        """The token ids a request's grammar starts after (`SamplingParams.reasoning_end_token_ids`): `</think>` as the
        model's tokenizer encodes it, without special tokens, so the grammar shapes the content and not the reasoning.
        Under `qwen3`, [] (the grammar from the first token) when `prompt` ends with those ids and whitespace: the chat
        template closed the reasoning before the reply (Qwen3's `enable_thinking: false`), and such a reply is all
        content. ValueError when `</think>` cannot be encoded (no tokenizer, no tokens, a token outside the
        vocabulary)."""
        if tokenizer is None:
            raise ValueError(f"{END!r}: the model has no tokenizer to encode it (a grammar starts after it)")
        ids = [int(t) for t in tokenizer.encode(END, add_special_tokens=False)]
        if not ids:
            raise ValueError(f"{END!r}: the model's tokenizer encodes it to no tokens")
        outside = [t for t in ids if not 0 <= t < vocab_size]
        if outside:
            raise ValueError(f"{END!r} encodes to token {outside[0]}, outside the vocabulary (size {vocab_size})")
        if not self.opened_by_template and _closed_at_the_end(prompt, ids, tokenizer):
            return []
        return ids


def _closed_at_the_end(prompt: Sequence[int], end: list[int], tokenizer: Any) -> bool:
    """Whether `prompt` ends with `end` then whitespace only."""
    n = len(end)
    for start in range(len(prompt) - n, -1, -1):
        if list(prompt[start : start + n]) == end:
            rest = list(prompt[start + n :])
            return not rest or not tokenizer.decode(rest, skip_special_tokens=False).strip()
    return False


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
