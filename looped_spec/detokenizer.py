"""Incremental detokenisation for streaming, and stop strings checked on the decoded text.

Byte-level tokenizers split multi-byte characters across tokens; decoding a token on its own gives
U+FFFD. Like vLLM, we decode a short window of tokens (`prefix_offset..`) and hold text back while
the window ends in an incomplete character, so a streamed delta never splits a character and the
concatenated deltas equal the text the output tokens add after the prompt. The window starts in the prompt's last
tokens, as vLLM's does: a SentencePiece decoder strips the first space of what it decodes, so the first output
token decoded alone would lose its space ("Paris" where the text after the prompt reads " Paris"); for byte-level
tokenizers the text is `tokenizer.decode(all output tokens)`.
"""

from __future__ import annotations

REPLACEMENT_CHAR = "\ufffd"
#: Prompt tokens the first decode window starts with (vLLM's count)
PROMPT_CONTEXT = 5


class IncrementalDetokenizer:
    """Turns a request's output tokens into text as they are committed; finds stop strings.

    `text` is the decoded output so far (cut before a stop string once one is found; without stop
    strings it is brought up to date by `stream_delta()` and `flush()`). Streaming
    reads `stream_delta()`, which holds back the last `max(len(stop)) - 1` characters while the
    request runs, so text that a later token turns into a stop string is never sent.
    """

    def __init__(
        self, tokenizer, stop: list[str] | None = None, skip_special_tokens: bool = True, include_stop: bool = False,
        prompt_token_ids: list[int] = (),
    ) -> None:  # fmt: skip
        self.tokenizer = tokenizer
        self.stop = [s for s in (stop or []) if s]
        self.skip_special_tokens = skip_special_tokens
        self.include_stop = include_stop  # keep the stop string in `text` (text after it is still cut)
        # the prompt's last tokens, then the output's: decode windows start in the prompt (module docstring), unless
        # its last tokens end inside a character (their U+FFFD would stand where the output completes it)
        context = list(prompt_token_ids[-PROMPT_CONTEXT:])
        if context and self._decode(context).endswith(REPLACEMENT_CHAR):
            context = []
        self._ids: list[int] = context
        self._num_context = len(context)
        self.text = ""
        self.stop_hit: str | None = None  # the stop string that ended the request
        self._prefix_offset = 0  # decode window start in `_ids` (context for the next token's text)
        self._read_offset = len(context)  # tokens of `_ids` whose text is already in self.text
        self._num_sent = 0  # characters of self.text already returned by stream_delta()
        # text a later token may turn into a stop string is held back; kept stop strings need no holding back
        self._holdback = 0 if include_stop else max((len(s) for s in self.stop), default=1) - 1

    @property
    def token_ids(self) -> list[int]:
        """The output tokens taken so far."""
        return self._ids[self._num_context :]

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def append(self, token_id: int, find_stop: bool = True) -> bool:
        """Add one committed token; returns True when a stop string now appears in the text. `find_stop=False`
        (a request's first min_tokens tokens) decodes without looking: text that ends before the first token looked
        at never stops the request, a stop string that runs on into it does.

        Without stop strings decoding waits for the next `stream_delta()` (one decode per step
        rather than per token, which matters when a speculative round commits several tokens).
        """
        self._ids.append(token_id)
        if self.stop_hit is not None:
            return True
        if not self.stop:
            return False
        start = len(self.text)
        try:
            return self._advance() and find_stop and self._find_stop(start)
        except BaseException:  # the tokenizer failed: the token is not taken (`_advance` assigns only once it decoded)
            self._ids.pop()
            raise

    def _advance(self) -> bool:
        """Decode the tokens not yet in `text`, unless they end in an incomplete character."""
        if self._read_offset == len(self._ids):
            return False
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(REPLACEMENT_CHAR):
            return False  # an incomplete character (or a skipped special token): wait for more tokens
        self.text += new_text[len(prefix_text) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return True

    def _find_stop(self, new_from: int) -> bool:
        """Look for a stop string that ends inside the text added at `new_from`."""
        if not self.stop:
            return False
        # each stop string from where an occurrence would end in the new text: text before it was looked at already,
        # or not to be looked at (a request's first min_tokens tokens)
        hits = [(i, s) for s in self.stop if (i := self.text.find(s, max(0, new_from - len(s) + 1))) >= 0]
        if not hits:
            return False
        index, stop = min(hits)
        self.text = self.text[: index + len(stop) if self.include_stop else index]
        self.stop_hit = stop
        return True

    def flush(self, find_stop: bool = True) -> bool:
        """The request finished: keep whatever an incomplete trailing character decodes to (U+FFFD), cut at a stop
        string that text completes (`find_stop`: the output reached its min_tokens). Returns whether it completed
        one."""
        if self.stop_hit is None and self._read_offset < len(self._ids):
            prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
            new_text = self._decode(self._ids[self._prefix_offset :])
            start = len(self.text)
            self.text += new_text[len(prefix_text) :]
            self._read_offset = len(self._ids)
            return find_stop and self._find_stop(start)
        return False

    @property
    def sent_text(self) -> str:
        """The text `stream_delta` has returned so far."""
        return self.text[: self._num_sent]

    def stream_delta(self, finished: bool) -> str:
        """Text not yet returned; while running, minus what could still become a stop string."""
        if not self.stop:
            self._advance()
        end = len(self.text) if finished else max(self._num_sent, len(self.text) - self._holdback)
        delta = self.text[self._num_sent : end]
        self._num_sent = end
        return delta
