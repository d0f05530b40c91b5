"""Turning user prompts (text, token ids, or vLLM's prompt dicts) into token-id lists, with clear errors."""

from __future__ import annotations

import numbers
import operator
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, TypedDict

from looped_spec.models.checkpoint import CheckpointError
from looped_spec.sampling_params import GREEDY_TEMPERATURE, SamplingParams


class _PromptOptions(TypedDict, total=False):
    cache_salt: str | None  # prefix caching shares blocks only among requests of the same salt


class TextPrompt(_PromptOptions):
    """vLLM's text prompt dict: `{"prompt": str}`, optionally with a `cache_salt`."""

    prompt: str


class TokensPrompt(_PromptOptions, total=False):
    """vLLM's token prompt dict: `{"prompt_token_ids": list[int]}`, optionally with a `cache_salt` and the `prompt`
    text the ids came from (the ids are what runs; the text is the output's `prompt`)."""

    prompt_token_ids: list[int]
    prompt: str


Prompt = str | list[int] | TextPrompt | TokensPrompt

# keys of vLLM's prompt dicts this engine does not implement (a None value asks for nothing and is accepted, as in vLLM)
UNSUPPORTED_PROMPT_KEYS = {
    "multi_modal_data": "the models served here take text only",
    "mm_processor_kwargs": "the models served here take text only",
    "multi_modal_uuids": "the models served here take text only",
    "token_type_ids": "it is for cross-encoder scoring models",
    "prompt_embeds": "pass token ids or text",
    "encoder_prompt": "the models served here are decoder-only",
    "decoder_prompt": "the models served here are decoder-only",
}
PROMPT_KEYS = ("prompt", "prompt_token_ids", "cache_salt")


def load_tokenizer(folder: str | None):
    """The checkpoint's tokenizer via transformers' AutoTokenizer (never remote code), or None."""
    if folder is None:
        return None
    path = Path(folder)
    if not any((path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    import warnings

    from transformers import AutoTokenizer
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER
    from transformers.utils import logging as hf_logging

    # transformers also parses config.json, whose model_type it does not know: that is expected here
    level = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tokenizer = AutoTokenizer.from_pretrained(str(path), trust_remote_code=False)
    except Exception as exc:  # tokenizers and transformers raise many types; name the files either way
        names = [n for n in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model") if (path / n).is_file()]
        files = ", ".join(str(path / n) for n in names)
        reason = " ".join(str(exc).split()) or type(exc).__name__
        raise CheckpointError(f"{files}: cannot load the tokenizer ({reason})") from exc
    finally:
        hf_logging.set_verbosity(level)
    # the engine enforces max_model_len itself (one error naming it): transformers' own limit would only add its
    # "Token indices sequence length is longer than ..." warning when a long prompt is encoded
    tokenizer.model_max_length = VERY_LARGE_INTEGER
    return tokenizer


def normalize_prompts(prompts: Any) -> list[Prompt]:
    """str | list[int] | a prompt dict, or a list of those -> list of prompts (each checked later, by
    `split_prompt`)."""
    if isinstance(prompts, (str, dict)):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty")
        if isinstance(prompts[0], numbers.Number):  # token ids: `to_token_ids` names the one that is not an id
            return [list(prompts)]
        return list(prompts)
    raise TypeError(
        f"prompts must be a string, token ids, a prompt dict, or a list of those; got {type(prompts).__name__}"
    )


def is_token_id(value: Any) -> bool:
    """Whether `value` is an integer of any type (numpy's too: numpy's numbers are numbers), never a bool."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_cache_salt(salt: Any, where: str = "cache_salt") -> str | None:
    """`salt` if it is a non-empty string or None (no salt), else an error naming `where` (vLLM's server refuses an
    empty one too; its offline engine would treat it as no salt)."""
    if salt is None:
        return None
    if not isinstance(salt, str):
        raise TypeError(f"{where} must be a string, got {type(salt).__name__}")
    if not salt:
        raise ValueError(f"{where} must be a non-empty string (leave it out for no salt)")
    return salt


def split_prompt(prompt: Any, where: str = "prompt") -> tuple[Any, str | None]:
    """(text or token ids, cache_salt or None) of a prompt: a string or token ids as they are (no salt), or vLLM's
    `{"prompt": text}` / `{"prompt_token_ids": ids}` (with both, the ids: `prompt_text` gives the text) with an optional
    `"cache_salt"`. A dict with neither, a key this engine does not implement (vLLM's `multi_modal_data`, ...) or an
    unknown one, or a value of the wrong type: an error naming `where` and the key. The text or ids themselves are
    checked by `to_token_ids`."""
    if not isinstance(prompt, dict):
        return prompt, None
    for key, value in prompt.items():
        if key in PROMPT_KEYS:
            continue
        if key in UNSUPPORTED_PROMPT_KEYS:
            if value is None:
                continue
            raise ValueError(f"{where}: {key!r} is not supported ({UNSUPPORTED_PROMPT_KEYS[key]})")
        known = ", ".join(repr(k) for k in PROMPT_KEYS)
        raise ValueError(f"{where}: unknown key {key!r} (a prompt dict takes {known})")
    salt = check_cache_salt(prompt.get("cache_salt"), f"{where}.cache_salt")
    if "prompt" in prompt:
        text = prompt["prompt"]
        if not isinstance(text, str):
            raise TypeError(f"{where}.prompt must be a string, got {type(text).__name__}")
        if "prompt_token_ids" not in prompt:
            return text, salt
    if "prompt_token_ids" in prompt:  # beside a "prompt", the ids run (vLLM's TokensPrompt: the text they came from)
        ids = prompt["prompt_token_ids"]
        if not isinstance(ids, (list, tuple)):
            raise TypeError(f"{where}.prompt_token_ids must be a list of token ids, got {type(ids).__name__}")
        return ids, salt
    raise ValueError(f"{where}: a prompt dict needs 'prompt' (text) or 'prompt_token_ids'")


def prompt_text(prompt: Any) -> str | None:
    """The text of a prompt (a string, or a prompt dict's "prompt"; None for token ids alone): the output's `prompt`."""
    if isinstance(prompt, dict):
        text = prompt.get("prompt")
        return text if isinstance(text, str) else None
    return prompt if isinstance(prompt, str) else None


def check_text(text: str, where: str) -> None:
    """ValueError naming `where` for text that is not valid Unicode (a lone surrogate, from JSON or undecodable
    command-line bytes: no tokenizer can encode it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(f"{where}: not valid Unicode text ({exc.reason} at character {exc.start})") from None


def check_vocabulary(ids: list[int], vocab_size: int, where: str) -> None:
    """ValueError naming the first of `ids` outside the vocabulary, as `where[i]`."""
    bad = next((i for i, token in enumerate(ids) if not 0 <= token < vocab_size), None)
    if bad is not None:
        raise ValueError(f"{where}[{bad}] = {ids[bad]} is outside the vocabulary [0, {vocab_size})")


def check_encoded_vocabulary(ids: list[int], vocab_size: int, where: str) -> None:
    """ValueError naming `where` (text) when the tokenizer encoded it to a token outside the model's vocabulary (a
    tokenizer with more tokens than the model has embeddings): the model cannot run that token."""
    outside = next((token for token in ids if not 0 <= token < vocab_size), None)
    if outside is not None:
        raise ValueError(f"{where}: its text encodes to token {outside}, outside the model's vocabulary [0, "
                         f"{vocab_size}) (the tokenizer has more tokens than the model)")  # fmt: skip


def check_prompt_room(num_tokens: int, max_model_len: int, where: str) -> None:
    """ValueError naming `where` when a prompt of `num_tokens` leaves no room to generate within `max_model_len`."""
    if num_tokens >= max_model_len:
        raise ValueError(f"{where} has {num_tokens} tokens; max_model_len={max_model_len} leaves no room to generate "
                         "(needs prompt length < max_model_len)")  # fmt: skip


def check_bias_tokens(bias: dict[int, float], vocab_size: int, where: str = "logit_bias") -> None:
    """ValueError naming the first token id of a logit bias outside the vocabulary, as `where`."""
    outside = next((token for token in bias if not 0 <= token < vocab_size), None)
    if outside is not None:
        raise ValueError(f"{where}: token id {outside} is outside the vocabulary [0, {vocab_size})")


def check_top_count(count: int | None, vocab_size: int, where: str) -> None:
    """ValueError naming `where` (`logprobs`, `prompt_logprobs`) when it asks for more most likely tokens than the
    vocabulary holds (a model of fewer than 20 tokens): the top-N could not be taken at any position."""
    if count is not None and count > vocab_size:
        raise ValueError(f"{where}={count}: more most likely tokens than the model's vocabulary holds ({vocab_size})")


def bad_word_token_ids(words: list[str], tokenizer, vocab_size: int, where: str = "bad_words") -> list[list[int]]:
    """The token sequences a request's bad_words ban, as vLLM encodes them (`SamplingParams.update_from_tokenizer`):
    each word without its leading whitespace, then a space and that, both without special tokens; the second is kept
    only where it has as many tokens as the first and another first token (a tokenizer that folds a word's leading
    space into its first token: the word inside text). ValueError naming `where` (or `where[i]`) without a tokenizer,
    or for a word that encodes to nothing or outside the vocabulary."""
    if tokenizer is None:
        raise ValueError(f"{where}: the model has no tokenizer files to encode the words with")
    sequences = []
    for i, word in enumerate(words):
        check_text(word, f"{where}[{i}]")
        stripped = word.lstrip()
        plain = list(tokenizer.encode(stripped, add_special_tokens=False)) if stripped else []
        if not plain:
            raise ValueError(f"{where}[{i}] = {word!r} encodes to no tokens")
        spaced = list(tokenizer.encode(" " + stripped, add_special_tokens=False))
        for ids in (plain, spaced) if len(spaced) == len(plain) and spaced[0] != plain[0] else (plain,):
            outside = next((token for token in ids if not 0 <= token < vocab_size), None)
            if outside is not None:
                raise ValueError(f"{where}[{i}] = {word!r} encodes to token {outside}, outside the vocabulary "
                                 f"[0, {vocab_size})")  # fmt: skip
            sequences.append(ids)
    return sequences


def check_bad_word_room(
    sequences: list[list[int]], allowed_token_ids: list[int] | None, min_tokens: int, stops: set[int], vocab_size: int
) -> None:
    """ValueError naming bad_words when its one-token words leave no token to generate (of allowed_token_ids, if
    set), or none but stop tokens before min_tokens. (Where words of several tokens mask all that is left at one
    position, those words give way there: execution/sampler.py.)"""
    single = {ids[0] for ids in sequences if len(ids) == 1}
    if allowed_token_ids is not None:
        left = set(allowed_token_ids) - single
        count, stops_left = len(left), len(left & stops)
    else:
        count = vocab_size - len(single)
        stops_left = len(stops - single)
    if not count:
        where = "allowed_token_ids" if allowed_token_ids is not None else "the vocabulary"
        raise ValueError(f"bad_words: every token of {where} is a one-token bad word, so none may be generated")
    if min_tokens and count == stops_left:
        raise ValueError(f"bad_words: every token they leave is a stop token (eos or stop_token_ids), so none may be "
                         f"sampled before min_tokens={min_tokens}")  # fmt: skip


def to_token_ids(prompt: Prompt, tokenizer, vocab_size: int, where: str = "prompt") -> list[int]:
    """The token ids of `prompt` (text, token ids or a prompt dict, whose cache_salt is not read here); errors name
    `where` (`where.prompt_token_ids` inside a dict)."""
    if isinstance(prompt, dict):
        content, _ = split_prompt(prompt, where)
        key = "prompt" if isinstance(content, str) else "prompt_token_ids"
        return to_token_ids(content, tokenizer, vocab_size, f"{where}.{key}")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{where} is text, but the model has no tokenizer files; pass token ids instead")
        check_text(prompt, where)
        ids = list(tokenizer.encode(prompt))
        check_encoded_vocabulary(ids, vocab_size, where)
    elif isinstance(prompt, (list, tuple)):
        for i, token in enumerate(prompt):
            if not is_token_id(token):
                raise TypeError(f"{where}[{i}] = {token!r} is not an int token id")
        ids = [operator.index(token) for token in prompt]
        check_vocabulary(ids, vocab_size, where)
    else:
        raise TypeError(f"{where} must be a string, a list of token ids or a prompt dict; got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"{where} is empty")
    return ids


#: The sampling filters and their neutral values
SAMPLING_FILTERS = (("top_k", (0, -1)), ("top_p", (1.0,)), ("min_p", (0.0,)))


@contextmanager
def naming(where: str | None) -> Iterator[None]:
    """Prefix a ValueError / TypeError raised inside with `where` (`sampling_params[2]: top_k=5: ...`: which entry of
    a list is at fault), its class and traceback kept; `where` None leaves it as raised. One whose text is not its
    one argument (pydantic's ValidationError, a UnicodeError, several arguments) is named in a new ValueError /
    TypeError raised from it, left whole."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        if where is None:
            raise
        if exc.args == (str(exc),):
            exc.args = (f"{where}: {exc.args[0]}",)
            raise
        raise (TypeError if isinstance(exc, TypeError) else ValueError)(f"{where}: {exc}") from exc


def check_filters_sample(params: SamplingParams, given: set[str]) -> None:
    """top_k, top_p and min_p filter what is sampled. With the temperature left unset a request decodes greedily here
    (this engine's default temperature is 0, vLLM's 1; or the checkpoint's generation_config.json does not sample), so
    a filter given then would do nothing: an error naming it, not a greedy decode the caller did not ask for. `given`:
    the fields the caller set."""
    if "temperature" in given or params.temperature >= GREEDY_TEMPERATURE:
        return
    for name, neutral in SAMPLING_FILTERS:
        value = getattr(params, name)
        if name in given and value not in neutral:
            raise ValueError(
                f"{name}={value}: the temperature is unset, so the request decodes greedily (this engine's default "
                f"temperature is 0, vLLM's 1.0) and {name} would do nothing; set temperature (e.g. temperature=1.0) "
                f"to sample, or leave {name} out"
            )


def end_tokens(adapter: Any, tokenizer: Any) -> list[int]:
    """The tokens that end a request as eos: the model's (config.json's and generation_config.json's) and the
    tokenizer's, which ends a chat model's turn and may be another token (vLLM stops on it too)."""
    turn_end = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    extra = [turn_end] if isinstance(turn_end, int) and 0 <= turn_end < adapter.vocab_size else []
    return list(dict.fromkeys([*adapter.eos_token_ids, *extra]))
