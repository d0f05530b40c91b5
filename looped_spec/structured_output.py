"""Structured outputs: a grammar (a JSON schema, any JSON object, a regular expression, a choice of strings, or a Lark
or GBNF grammar) that every generated token keeps satisfiable, as vLLM's `structured_outputs`.

llguidance matches token sequences against the grammar. At every position the sampler masks the tokens that would
break it (execution/sampler.py); a request ends ("stop") once its grammar is complete. A speculative position's mask
is the grammar's state after the committed output and the drafts before that position, the same prefix the penalties
count: a draft and its verification mask alike, so greedy speculation equals plain decoding and rejection sampling
keeps the constrained distribution (docs/architecture.md, "What p and q are").

A grammar may start after a gate (`SamplingParams.reasoning_end_token_ids`, or the engine's `reasoning_parser`: a
thinking model's `</think>`): a token sequence after whose first occurrence in the output the grammar applies to every
later token. Before it the grammar masks nothing and consumes nothing, and the request cannot complete it. Only output
tokens count, the drafts before a position among them, never the prompt: a gate that opens inside a round's drafts
masks the later draft positions with the grammar advanced by the drafts after the gate.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

if TYPE_CHECKING:
    import torch

#: the one field of `StructuredOutputs` to set, each a kind of grammar
KINDS = ("json", "json_object", "regex", "choice", "grammar")
#: JSON is written as Python's json.dumps writes it (", " and ": ", no other whitespace): with any whitespace allowed a
#: model may pad an object with newlines until max_tokens. A schema's "x-guidance" object overrides it (llguidance's
#: JSON options, e.g. {"whitespace_flexible": true})
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class StructuredOutputs(BaseModel):
    """The grammar a request's output must follow: set exactly one field."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON schema (a dict, or its JSON text) the output is an instance of."
    )
    json_object: bool = Field(False, description="Any JSON object.")
    regex: str | None = Field(None, description="A regular expression the whole output matches.")
    choice: list[str] | None = Field(None, min_length=1, description="One of these strings, exactly.")
    grammar: str | None = Field(
        None, description="A context-free grammar in Lark syntax (llguidance's dialect), or in GBNF (`root ::= ...`)."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredOutputs:
        chosen = [kind for kind in KINDS if self.kind_value(kind) not in (None, False)]
        if len(chosen) != 1:
            raise ValueError(f"set exactly one of {', '.join(KINDS)} (got {', '.join(chosen) or 'none'})")
        return self

    def kind_value(self, kind: str) -> Any:
        return self.json_schema if kind == "json" else getattr(self, kind)

    @property
    def kind(self) -> str:
        return next(kind for kind in KINDS if self.kind_value(kind) not in (None, False))

    def lark(self) -> str:
        """The grammar as llguidance takes it."""
        from llguidance import LLMatcher

        kind = self.kind
        if kind == "json":
            schema = self.json_schema
            schema = json.loads(schema) if isinstance(schema, str) else schema
            if schema is True:  # JSON Schema's boolean form: any JSON value (llguidance takes object schemas only)
                schema = {}
            elif schema is False:
                raise ValueError("false is the schema no value satisfies")
            if isinstance(schema, dict) and "x-guidance" in schema and not isinstance(schema["x-guidance"], dict):
                raise ValueError("x-guidance must be an object of llguidance's JSON options")  # it drops others
            # handed over as text: llguidance reads a dict by recursing on the native stack, which a schema nested
            # some thousands deep overflows (the process dies), where json.dumps raises RecursionError
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=JSON_LAYOUT)
        if kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(self.regex)
        if kind == "choice":  # Lark string literals take JSON's escapes
            return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(text) for text in self.choice))
        if GBNF_RULE.search(self.grammar) and not LARK_START.search(self.grammar):
            return LLMatcher.grammar_from_lark(gbnf_as_lark(self.grammar))
        return LLMatcher.grammar_from_lark(self.grammar)


#: a GBNF rule (llama.cpp's EBNF, `name ::= ...`), which no Lark grammar writes at the start of a line
GBNF_RULE = re.compile(r"(?m)^\s*[A-Za-z][\w-]*\s*::=")
#: what makes a grammar Lark (llguidance's own test, `gbnf_to_lark.is_lark_syntax`): its `start` rule (`?start:`
#: too; not GBNF's `start ::=`) or the `%llguidance` header, whatever a line inside a multi-line regex looks like
LARK_START = re.compile(r"(?m)^\s*(?:%llguidance\b|[?!]?start\s*:(?!:=))")


def gbnf_as_lark(grammar: str) -> str:
    """A GBNF grammar (vLLM's docs write them so: xgrammar's EBNF, which llguidance also reads) in Lark."""
    from llguidance.gbnf_to_lark import gbnf_to_lark

    try:
        return gbnf_to_lark(grammar)
    except Exception as exc:  # llguidance's GbnfToLarkError, and anything its converter trips on
        raise ValueError(f"GBNF: {' '.join(str(exc).split())}") from exc


class GrammarCompiler:
    """Turns `StructuredOutputs` into matchers over one model's tokenizer and vocabulary (the tokenizer is converted
    for llguidance once, at the first request that asks)."""

    #: compiled grammars kept (each a pristine matcher a request's matcher is copied from)
    CACHED = 64

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Sequence[int]) -> None:
        self.hf_tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)  # the engine's (`end_tokens`: the tokenizer's eos among them)
        self._tokenizer = None
        # grammar text -> a matcher at the start of the output: a server checks a request's grammar before it admits
        # the request, and a request's n choices share one grammar, so each compiles once (a large schema takes
        # tenths of a second); compiled from the server's threads and the engine's, hence the lock
        self._compiled: OrderedDict[str, Any] = OrderedDict()
        self._lock = threading.Lock()

    def compile(self, spec: StructuredOutputs, where: str = "structured_outputs", gate: Sequence[int] = ()) -> Grammar:
        """A request's grammar at the start of its output, applying after `gate` (empty: from the first token);
        ValueError naming `where` and the field for a grammar that does not compile, a model without a tokenizer, or
        llguidance not installed."""
        field = f"{where}.{spec.kind}"
        if self.hf_tokenizer is None:
            raise ValueError(f"{field}: structured outputs need the model's tokenizer files")
        try:
            import llguidance
            import llguidance.hf
        except ImportError as exc:
            raise ValueError(
                f"{field}: structured outputs need llguidance (pip install 'looped-spec[structured]')"
            ) from exc
        if self._tokenizer is None:
            self._tokenizer = llguidance.hf.from_tokenizer(
                self.hf_tokenizer, n_vocab=self.vocab_size, eos_token=self.eos_token_ids or None
            )
        try:
            grammar = spec.lark()
        except (ValueError, TypeError) as exc:  # a schema given as text that is not JSON, or not a schema object
            raise ValueError(f"{field}: {exc}") from exc
        except RecursionError as exc:  # a schema nested deeper than Python's JSON coder goes (as text, or as a dict)
            raise ValueError(f"{field}: nested too deeply") from exc
        with self._lock:
            pristine = self._compiled.get(grammar)
            if pristine is not None:
                self._compiled.move_to_end(grammar)
        if pristine is None:
            # silent: a refused token is reported by `Grammar.consume`, not printed to stderr
            pristine = llguidance.LLMatcher(self._tokenizer, grammar, log_level=0)
            if pristine.is_error():
                raise ValueError(f"{field}: {' '.join(pristine.get_error().split())}")
            # a grammar no text satisfies (a regex such as a[^\s\S]b, a $ref cycle) compiles, and llguidance finds
            # it when it computes the first mask: a copy computes it here, so the request is refused with the field
            # named (a server's 400) rather than failed once generating (a 500)
            probe = pristine.deep_copy()
            probe.compute_bitmask()
            if probe.is_error():
                reason = probe.get_error().strip().splitlines()[0]  # the rest dumps the parser
                raise ValueError(f"{field}: no text satisfies the grammar ({reason})")
            with self._lock:
                self._compiled[grammar] = pristine
                while len(self._compiled) > self.CACHED:
                    self._compiled.popitem(last=False)
        return Grammar(pristine.deep_copy(), self.vocab_size, gate)


class Grammar:
    """One request's grammar state: the matcher advanced by the request's committed tokens after its gate (every
    committed token when the gate is empty)."""

    def __init__(self, matcher: Any, vocab_size: int, gate: Sequence[int] = ()) -> None:
        self.matcher = matcher
        self.vocab_size = vocab_size
        self.gate = tuple(gate)
        self.opened = not self.gate  # whether the output holds the gate: the grammar applies from there on
        self.before: list[int] = []  # the committed output up to the gate's first occurrence (the gate included)
        self.after = 0  # committed tokens after it (each consumed by the matcher)

    def consume(self, token: int) -> None:
        """Advance by a committed token (ValueError if the grammar refuses it: the sampler masks such tokens). Before
        the gate opens the token is only looked at: the one that ends the gate opens it."""
        if not self.opened:
            self.before.append(token)
            n = len(self.gate)
            self.opened = len(self.before) >= n and tuple(self.before[-n:]) == self.gate
            return
        if not self.matcher.consume_token(token):
            reason = (self.matcher.get_error() or "refused").strip().splitlines()[0]  # the rest dumps the parser
            raise ValueError(f"structured_outputs: token {token} does not follow the grammar ({reason})")
        if self.matcher.is_error():
            # a grammar no text satisfies, or a parser limit hit while a mask was computed: the matcher then allows
            # only the end of sequence and says it stopped, which is a failed request, not a completed output
            reason = (self.matcher.get_error() or "no text satisfies it").strip().splitlines()[0]
            raise ValueError(f"structured_outputs: the grammar cannot be followed ({reason})")
        self.after += 1

    def rollback(self, tokens: int) -> None:
        """Undo the last `tokens` tokens consumed (those before the gate too: the gate closes again if one of its
        tokens is undone)."""
        undone = min(tokens, self.after)
        if undone:
            self.matcher.rollback(undone)
            self.after -= undone
        rest = tokens - undone
        if rest:
            del self.before[len(self.before) - rest :]
            self.opened = not self.gate  # its first occurrence ended at the last token undone

    def after_gate(self, drafted: Sequence[int]) -> list[int] | None:
        """Of `drafted` (tokens after the committed output), those after the gate: what the grammar takes before the
        position after them; None when the gate is still closed there (the position is free)."""
        if self.opened:
            return list(drafted)
        n = len(self.gate)
        # not in the output yet: its first occurrence ends in the drafts (it is n long, the tail kept at most n - 1)
        tail = self.before[-(n - 1) :] if n > 1 else []
        seq = [*tail, *drafted]
        for end in range(n, len(seq) + 1):
            if tuple(seq[end - n : end]) == self.gate:
                return seq[end:]
        return None

    @property
    def complete(self) -> bool:
        """Nothing may follow: the request ends here (never before the gate opened)."""
        return self.opened and self.matcher.is_stopped() and not self.matcher.is_error()


def allowed_tokens(grammars: Sequence[Grammar], drafted: Sequence[Sequence[int]]) -> torch.Tensor:
    """[len(grammars), V] bool: the tokens each grammar allows after its `drafted` tokens (each is left as it was):
    after the drafts that follow its gate, every token where the gate is still closed after them. A position after a
    draft the grammar refuses, or after the grammar completed, allows every token: its request never commits a token
    there (the refused draft is rejected, a completed grammar ends the request). A grammar that met a dead end (its
    matcher's error state) allows only the end of sequence, at every position after it."""
    import torch

    vocab_size = grammars[0].vocab_size
    # one bit per token, 32 to an int32 word (llguidance's layout); filled through the matcher's pointer call
    # (llguidance.torch wraps the same call, and importing it imports torch's compiler: seconds at the first request)
    bitmask = torch.full((len(grammars), (vocab_size + 31) // 32), -1, dtype=torch.int32)
    row_bytes = bitmask.shape[1] * 4
    for row, (grammar, drafts) in enumerate(zip(grammars, drafted)):
        tokens = grammar.after_gate(drafts)
        if tokens is None:  # the gate is closed at this position: the grammar masks nothing yet
            continue
        # the drafts are taken by a copy (a microsecond or so), which leaves the request's matcher at the committed
        # output whatever happens: llguidance keeps an error state through a rollback, so a mask that met a dead end
        # only past the drafts (a branch no text completes) failed the committed output where a draft was rejected
        matcher = grammar.matcher.deep_copy() if tokens else grammar.matcher
        taken = matcher.try_consume_tokens(list(tokens)) if tokens else 0
        # a matcher in its error state says it stopped too, and allows only the end of sequence at every ask: asked
        # for its mask, the draft and the verifier see that one (its request then fails at commit, as plain decoding)
        if taken == len(tokens) and (not matcher.is_stopped() or matcher.is_error()):  # else every token (docstring)
            matcher.unsafe_compute_mask_ptr(bitmask[row].data_ptr(), row_bytes)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(len(grammars), -1)[:, :vocab_size].bool()
