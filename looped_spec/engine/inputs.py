"""Turning user prompts (text or token ids) into token-id lists, with clear errors."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from looped_spec.models.checkpoint import CheckpointError

Prompt = str | list[int]


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
    """str | list[str] | list[int] | list[list[int]] -> list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise ValueError("prompts is empty")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]
        return list(prompts)
    raise TypeError(f"prompts must be a string, token ids, or a list of those; got {type(prompts).__name__}")


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


def check_bias_tokens(bias: dict[int, float], vocab_size: int, where: str = "logit_bias") -> None:
    """ValueError naming the first token id of a logit bias outside the vocabulary, as `where`."""
    outside = next((token for token in bias if not 0 <= token < vocab_size), None)
    if outside is not None:
        raise ValueError(f"{where}: token id {outside} is outside the vocabulary [0, {vocab_size})")


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
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError(f"{where} is text, but the model has no tokenizer files; pass token ids instead")
        check_text(prompt, where)
        ids = list(tokenizer.encode(prompt))
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
        for i, token in enumerate(ids):
            if not isinstance(token, int) or isinstance(token, bool):
                raise TypeError(f"{where}[{i}] = {token!r} is not an int token id")
        check_vocabulary(ids, vocab_size, where)
    else:
        raise TypeError(f"{where} must be a string or a list of token ids; got {type(prompt).__name__}")
    if not ids:
        raise ValueError(f"{where} is empty")
    return ids
