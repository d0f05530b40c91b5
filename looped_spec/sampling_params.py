"""User-facing request parameters, validated at the boundary (pydantic)."""

from __future__ import annotations

import difflib
import numbers
import operator
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from looped_spec.structured_output import StructuredOutputs

# Below this a softmax temperature divides logits into overflow (1e-45 gives token 0 everywhere): such a
# temperature means "greedy". vLLM raises a temperature in (0, 1e-2) to 1e-2 (with a warning) and samples; here one
# of at least 1e-5 is kept as asked, which fp32 logits divide by without overflow.
GREEDY_TEMPERATURE = 1e-5
# Above this the sampler's fp32 temperature is inf: logits divided by it are 0 (every token alike, top-k ignored) and
# NaN where masked (-inf), so a masked token could come (token 0 everywhere). Near it, every kept token is equally
# likely already.
MAX_TEMPERATURE = 3.4e38


def _integral(value: Any) -> Any:
    """Any integral number (numpy's too) as an int; bool, str and float are left for strict validation to refuse."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return operator.index(value)
    return value


def _real(value: Any) -> Any:
    """Any real number (numpy's too) as a float; bool and str are left for strict validation to refuse."""
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    return value


def _token_key(value: Any) -> Any:
    """A token id as a dict key: an integer, or the decimal digits JSON writes an integer key as (OpenAI's logit_bias):
    ASCII, without leading zeros, so two keys never name one token."""
    if isinstance(value, str):
        if not is_token_key(value):
            raise ValueError(f"key {value!r} is not a token id (a non-negative integer, written without leading zeros)")
        return int(value)
    return _integral(value)


def is_token_key(text: str) -> bool:
    """Whether `text` is a token id as JSON keys write one: ASCII digits, no leading zero (but "0" itself)."""
    return text.isascii() and text.isdigit() and (text == "0" or not text.startswith("0"))


#: an int of any integer type (numpy's included), never a bool, str or float: strict but not fussy
Integer = Annotated[int, BeforeValidator(_integral)]
#: a token id as a dict key: an Integer, or a string of digits (JSON's keys are strings)
TokenKey = Annotated[int, BeforeValidator(_token_key)]
#: a float from any real number type, never a bool or str
Real = Annotated[float, BeforeValidator(_real)]


#: vLLM SamplingParams fields this engine has no field for, and what to use instead
VLLM_FIELDS = {
    "guided_decoding": "vLLM's older name: use structured_outputs=StructuredOutputs(...)",
    "detokenize": "not a field here: outputs carry text whenever the model has a tokenizer, and token_ids always",
    "output_kind": "not a field here: every output of step() and of the async generate() holds vLLM's "
    "CUMULATIVE: outputs[0].text and token_ids so far, and its DELTA: new_text, new_token_ids (what it adds); "
    "FINAL_ONLY: the output whose finished is True",
    "truncate_prompt_tokens": "not supported: shorten the prompt before giving it (a prompt over max_model_len is an "
    "error)",
    "logits_processors": "not supported: logit_bias, allowed_token_ids, bad_words and structured_outputs adjust "
    "logits here (and keep speculation exact)",
    "spaces_between_special_tokens": "not supported: special tokens are decoded as the tokenizer's decode() does "
    "(skip_special_tokens drops them)",
}


class SamplingParams(BaseModel):
    """How to generate for one request. Impossible values raise a ValidationError naming the field; types are strict
    (`max_tokens="8"` or `max_tokens=True` is an error, not 8 or 1; any integer type, numpy's too, is an int, and any
    real number a float)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    max_tokens: Integer | None = Field(
        16, gt=0, description="Most tokens to generate; None: as many as max_model_len leaves (vLLM's None)."
    )
    min_tokens: Integer = Field(
        0,
        ge=0,
        description="Fewest tokens to generate before a stop can end the request, as in vLLM: the first min_tokens "
        "tokens are never stop tokens (eos, under ignore_eos too as vLLM masks it, and stop_token_ids: masked in the "
        "sampler) and a stop string must end in the text of a later token. At most max_tokens; 0 = off.",
    )
    temperature: Real = Field(
        0.0,
        ge=0.0,
        le=MAX_TEMPERATURE,
        allow_inf_nan=False,
        description="0 (or below 1e-5) = greedy; else softmax temperature (at most 3.4e38, fp32's range).",
    )
    top_k: Integer = Field(
        0,
        ge=-1,
        le=2**31 - 1,
        description="Keep the k most likely tokens, and those tied with the k-th, as HF and vLLM (0 or -1 = all).",
    )
    top_p: Real = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False, description="Nucleus sampling mass in (0, 1].")
    min_p: Real = Field(
        0.0,
        ge=0.0,
        le=1.0,
        allow_inf_nan=False,
        description="Keep the tokens at least min_p times as likely as the most likely one (after top-k and top-p, "
        "in HF's order); 0 = off.",
    )
    logit_bias: dict[TokenKey, Real] = Field(
        default_factory=dict,
        description="Added to the logits of these token ids before sampling (greedy too), each in [-100, 100] as in "
        "OpenAI's API: -100 all but bans a token, 100 all but forces it.",
    )
    repetition_penalty: Real = Field(
        1.0,
        ge=0.01,  # below it fp32 logits divided by it overflow
        le=100.0,
        allow_inf_nan=False,
        description="Divides the positive logits (multiplies the negative ones) of tokens in the prompt or the output "
        "so far, as vLLM and HF; 1 = off.",
    )
    presence_penalty: Real = Field(
        0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description="Subtracted from the logit of every token the output "
        "so far holds, as in OpenAI's API; 0 = off."
    )  # fmt: skip
    frequency_penalty: Real = Field(
        0.0, ge=-2.0, le=2.0, allow_inf_nan=False, description="Subtracted from a token's logit once per time the "
        "output so far holds it, as in OpenAI's API; 0 = off."
    )  # fmt: skip
    seed: Integer | None = Field(
        None, ge=0, le=2**63 - 1, description="Per-request seed; None (or -1, as vLLM reads it) = drawn from the "
        "engine seed."
    )  # fmt: skip
    stop_token_ids: list[Integer] = Field(
        default_factory=list,
        strict=False,
        description="Tokens that end the request (kept in token_ids; their text is left out of the text unless "
        "include_stop_str_in_output, as in vLLM).",
    )
    ignore_eos: bool = Field(False, description="Keep generating past the model's eos token.")
    allowed_token_ids: list[Integer] | None = Field(
        None,
        strict=False,
        min_length=1,
        description="Only these tokens may be generated (vLLM's): every other token's logit is masked, greedy "
        "decoding and drafts included. None: any token.",
    )
    bad_words: list[str] | None = Field(
        None,
        strict=False,
        description="Words that may not be generated (vLLM's): each is encoded with the model's tokenizer, as given "
        "(its leading whitespace stripped) and after a space, and the last token of each encoding is masked wherever "
        "the output before it ends with the others (a one-token word: everywhere), greedy decoding and drafts "
        "included. None: none.",
    )
    exit_threshold: Real | None = Field(
        None,
        gt=0.0,
        allow_inf_nan=False,
        description="Early-exit threshold of the family's rule (Ouro: cumulative exit probability tau; Huginn: "
        "convergence, e.g. KL 5e-4). None = the model's default (Ouro: config early_exit_threshold).",
    )
    exit_at_step: Integer | None = Field(
        None, ge=1, le=1 << 16, description="Fixed loop depth for every token of this request (any family)."
    )
    stop: list[str] = Field(
        default_factory=list,
        strict=False,
        description="Strings that end the request, checked on the decoded text (cut off); one string or a list.",
    )
    include_stop_str_in_output: bool = Field(
        False,
        description="Keep the stop string that ended the request (and a stop token's text) in the text, as in vLLM.",
    )
    skip_special_tokens: bool = Field(True, description="Leave special tokens (eos, chat markers) out of the text.")
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="A grammar the output follows (a JSON schema, any JSON object, a regex, a choice of strings or a "
        "Lark or GBNF grammar; structured_output.py); the request ends once it is complete. None = free text.",
    )
    reasoning_end_token_ids: list[Integer] | None = Field(
        None,
        strict=False,
        description="With structured_outputs: the token ids that end a thinking model's reasoning (its `</think>`); "
        "the grammar applies to the output after their first occurrence in it (the prompt never counts; the drafts "
        "before a speculative position do), and before it masks nothing (vLLM starts a grammar where its reasoning "
        "parser says the reasoning ended). [] = the grammar applies from the first token. None = the engine's "
        "`reasoning_parser` decides (its `</think>`; no engine parser: from the first token).",
    )
    logprobs: Integer | None = Field(
        None,
        ge=0,
        le=20,
        description="Return each generated token's log-probability and this many most likely tokens at its "
        "position: the log-softmax of the logits it was read out from, before the logit bias, penalties, "
        "allowed_token_ids, bad_words, min_tokens and grammar masks, temperature, top-k, top-p and min-p (the "
        "target's under speculation, the exit depth's under early exit: vLLM's raw log-probabilities). Each entry "
        "also reads as vLLM's dict token id -> Logprob (logprob, rank). None = none.",
    )

    prompt_logprobs: Integer | None = Field(
        None,
        ge=0,
        le=20,
        description="Return each prompt token's log-probability given the tokens before it (the first: None) and this "
        "many most likely tokens there, from the model's full-depth logits (`RequestOutput.prompt_logprobs`; a "
        "forward over the prompt at admission, as `LoopedSpecEngine.score`). None = none.",
    )

    @model_validator(mode="before")
    @classmethod
    def _known_fields(cls, data: Any) -> Any:
        """A field SamplingParams does not have is an error naming it, with the field it was likely meant to be (a
        vLLM field this engine runs elsewhere says where)."""
        if not isinstance(data, dict):
            return data
        # vLLM's neutral values of fields this engine has no use for: one output, and "unset"
        data = {name: value for name, value in data.items()
                if not (name in ("n", "best_of") and value in (None, 1) and not isinstance(value, bool))}  # fmt: skip
        for name in ("stop", "stop_token_ids", "logit_bias"):
            if name in data and data[name] is None:
                del data[name]  # vLLM's default: none
        for name in data:
            if name in cls.model_fields:
                continue
            if name in ("n", "best_of"):
                raise ValueError(f"{name}={data[name]!r}: one output per request here (RequestOutput holds one text); "
                                 "to draw several, give the prompt several times with seeds s, s+1, ... (the server's "
                                 "n does so)")  # fmt: skip
            if name in VLLM_FIELDS:
                raise ValueError(f"{name}: {VLLM_FIELDS[name]}")
            close = difflib.get_close_matches(str(name), list(cls.model_fields), n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ValueError(f"{name}: not a SamplingParams field{hint}")
        return data

    def clone(self) -> SamplingParams:
        """A copy (vLLM's `clone`); SamplingParams is frozen: `model_copy(update={...})` makes a changed one."""
        return self.model_copy(deep=True)

    @field_validator("seed", mode="before")
    @classmethod
    def _minus_one_is_no_seed(cls, value: Any) -> Any:
        # vLLM's rule (clients send -1 for "random"): an int -1, not True or -1.0, which the field's checks refuse
        return None if type(value) is int and value == -1 else value

    @field_validator("stop", mode="before")
    @classmethod
    def _one_string(cls, stop: Any) -> Any:
        """A single string is one stop string, as vLLM takes it (and the server's `stop`); an empty one is named as
        given, not as the list it becomes."""
        if stop == "":
            raise ValueError("an empty string (leave stop out for none)")
        return [stop] if isinstance(stop, str) else stop

    @field_validator("stop")
    @classmethod
    def _non_empty(cls, stop: list[str]) -> list[str]:
        for i, s in enumerate(stop):
            if not s:
                raise ValueError(f"stop[{i}] is an empty string")
        return stop

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _one_key_per_token(cls, bias: Any) -> Any:
        """Two keys naming one token (5 and "5") would leave one of their values silently dropped: an error."""
        if not isinstance(bias, dict):
            return bias
        seen: dict[Any, Any] = {}
        for key in bias:
            token = key if not isinstance(key, str) or not is_token_key(key) else int(key)
            if not isinstance(token, bool) and token in seen:
                raise ValueError(f"keys {seen[token]!r} and {key!r} both name token {token}: give it one value")
            seen[token] = key
        return bias

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, bias: dict[int, float]) -> dict[int, float]:
        for token, value in bias.items():
            if token < 0:
                raise ValueError(f"token id {token} is negative")
            if not -100.0 <= value <= 100.0:  # NaN fails too
                raise ValueError(f"logit_bias[{token}] = {value} must be in [-100, 100]")
        return bias

    @field_validator("stop_token_ids", "allowed_token_ids", "reasoning_end_token_ids")
    @classmethod
    def _non_negative(cls, ids: list[int] | None, info: ValidationInfo) -> list[int] | None:
        for i, token in enumerate(ids or []):
            if token < 0:
                raise ValueError(f"{info.field_name}[{i}] = {token} is negative")
        return ids

    @field_validator("bad_words")
    @classmethod
    def _words(cls, words: list[str] | None) -> list[str] | None:
        for i, word in enumerate(words or []):
            if not word.lstrip():  # vLLM encodes the word without its leading whitespace: nothing would be left
                raise ValueError(f"bad_words[{i}] = {word!r} is empty" + (" but for whitespace" if word else ""))
        return words

    @model_validator(mode="after")
    def _bad_words_without_a_grammar(self) -> SamplingParams:
        if self.bad_words and self.structured_outputs is not None:
            raise ValueError("bad_words and structured_outputs: set at most one (a grammar may leave only a bad "
                             "word's token to take; fold the bad words into the grammar)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _reasoning_end_with_a_grammar(self) -> SamplingParams:
        if self.reasoning_end_token_ids is not None and self.structured_outputs is None:
            raise ValueError("reasoning_end_token_ids: only with structured_outputs (they say where its grammar "
                             "starts)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _allowed_tokens_without_a_grammar(self) -> SamplingParams:
        if self.allowed_token_ids is not None and self.structured_outputs is not None:
            raise ValueError("allowed_token_ids and structured_outputs: set at most one (a grammar already decides "
                             "which tokens may come; fold the allowed tokens into it)")  # fmt: skip
        return self

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}")
        return self

    @model_validator(mode="after")
    def _one_exit_rule(self) -> SamplingParams:
        if self.exit_threshold is not None and self.exit_at_step is not None:
            raise ValueError(
                f"exit_threshold={self.exit_threshold} and exit_at_step={self.exit_at_step}: set at most one "
                "(a threshold lets each token choose its depth, exit_at_step fixes it)"
            )
        return self


def sampling_params_argument(sampling_params: Any, params: Any) -> Any:
    """The SamplingParams a call was given as `sampling_params` (vLLM's name) or `params` (this engine's older
    keyword, still taken): at most one of the two."""
    if sampling_params is not None and params is not None:
        raise TypeError("sampling_params and params: give one (params is the older name of sampling_params)")
    return params if sampling_params is None else sampling_params
