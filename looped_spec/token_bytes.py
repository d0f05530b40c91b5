"""A token's own bytes, how log-probabilities show it, and where it starts in the text.

A byte-level BPE token can hold part of a multi-byte character (the tiny models split "日" into three tokens). Decoded
alone such a token is U+FFFD, so two different tokens would show (and key `top_logprobs`) alike and a chat entry's
`bytes` would be the replacement character's. From the token's own bytes instead:

- a token whose bytes are valid UTF-8 shows as that text; any other as ``bytes:\\xe6\\x97`` (OpenAI's form);
- a chat entry's `bytes` are the token's bytes;
- a completions entry's `text_offset` is the character of the choice's text where the token starts: a token inside a
  character starts where that character does (an incremental UTF-8 decoder over the tokens' bytes).

A SentencePiece-style tokenizer (its decoder turns "▁" into a space, `<0xE6>` pieces into bytes) gives its pieces the
same way: decoded alone, "▁world" would lose its space (the decoder strips the text's first one) and a byte piece would
be U+FFFD. Any other tokenizer gives each token's decoded text as its bytes.
"""

from __future__ import annotations

import codecs
import json
import re

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _byte_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (as GPT-2 introduced it): the printable Latin-1 bytes stand for themselves, every
    other byte for the next unused code point from 256 on, in byte order. Returns character -> byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            chars[chr(byte)] = byte
        else:
            chars[chr(256 + extra)] = byte
            extra += 1
    return chars


def _sentencepiece_space(decoder) -> tuple[str, bool] | None:
    """For a decoder that follows SentencePiece (`Metaspace`, or a sequence replacing a character by a space): the
    character that stands for a space, and whether `<0xHH>` pieces are bytes (byte fallback). None for any other."""
    try:
        state = json.loads(decoder.__getstate__())
    except (AttributeError, TypeError, ValueError):
        return None
    parts = (state.get("decoders") or []) if state.get("type") == "Sequence" else [state]
    space, byte_fallback = None, False
    for part in parts:
        if part.get("type") == "Metaspace":
            space = part.get("replacement", "\u2581")
        elif part.get("type") == "Replace" and part.get("content") == " " and "String" in part.get("pattern", {}):
            space = part["pattern"]["String"]
        byte_fallback = byte_fallback or part.get("type") == "ByteFallback"
    return None if space is None else (space, byte_fallback)


class TokenBytes:
    """Bytes and display text of a tokenizer's tokens (see the module docstring)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._alphabet = _byte_alphabet() if type(decoder).__name__ == "ByteLevel" else None
        self._sentencepiece = _sentencepiece_space(decoder) if decoder is not None and self._alphabet is None else None
        self._special = set(getattr(tokenizer, "all_special_ids", ()))  # their text is their name, as decoded

    def raw(self, token: int) -> bytes:
        if self.tokenizer is None:
            return str(token).encode()
        if self._alphabet is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and all(c in self._alphabet for c in piece):
                return bytes(self._alphabet[c] for c in piece)
        elif self._sentencepiece is not None:
            piece = self.tokenizer.convert_ids_to_tokens(token)
            if isinstance(piece, str) and token not in self._special:
                space, byte_fallback = self._sentencepiece
                byte = _BYTE_PIECE.fullmatch(piece) if byte_fallback else None
                return bytes([int(byte.group(1), 16)]) if byte else piece.replace(space, " ").encode()
        return self.tokenizer.decode([token]).encode()

    def raw_at_start(self, token: int) -> bytes:
        """The bytes of `token` as the first of a decoded text, which a SentencePiece decoder strips of its space."""
        raw = self.raw(token)
        if self._sentencepiece is not None and raw.startswith(b" ") and token not in self._special:
            return self.tokenizer.decode([token]).encode()
        return raw

    def text(self, token: int, raw: bytes | None = None) -> str:
        """The token as log-probabilities show it: its text, or ``bytes:\\x..`` when its bytes are not UTF-8 (`raw`:
        its bytes, else `raw(token)`)."""
        raw = self.raw(token) if raw is None else raw
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)


class TextOffsets:
    """Character offsets of consecutive tokens in the text they decode to (one per choice, across stream chunks)."""

    def __init__(self) -> None:
        self.chars = 0
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def advance(self, raw: bytes) -> int:
        """The offset of the token with bytes `raw` (the characters completed before it), then move past it."""
        start = self.chars
        self.chars += len(self._decoder.decode(raw))
        return start
