"""Write the shipped evaluation prompt groups "code" and "prose" (looped_spec/tuning/prompt_data/*.json).

Both are text the shipped tiny models never trained on (they trained on standard-library files of <= 100 KB and
the HumanEval prompts, docs/tiny-models.md "Recipe") and that the "tune" group does not hold:

- ``code.json``: snippets of the installed torch's own Python sources (BSD-3-Clause; the header keeps its
  copyright lines and licence text), cut by the standard-library snippet rule (`CODE_RULE`).
- ``prose.json``: English paragraphs of the reference documentation in this Python's ``pydoc_data/topics.py``
  (PSF License Agreement; the header keeps its text and copyright notice). The file is 740 KB, over the 100 KB
  limit of the tiny models' training files, so they never trained on it (`PROSE_RULE`).

Each file's header records the package, version, source file(s), licence and the rule it was cut by.

In both, a snippet is dropped when its text (up to string literals and numbers) or a near copy of it (`similar`:
the Jaccard similarity of their runs of `SHINGLE` tokens >= `SIMILAR`) was already taken, or when it occurs in
the "tune" or "eval" group; each group is cut to `COUNT` snippets. The output depends only on the installed torch
and Python (recorded in each file's header), so re-running with the same versions rewrites the same bytes
(``--check`` verifies that).

    python scripts/extract_prompts.py            # writes looped_spec/tuning/prompt_data/{code,prose}.json
    python scripts/extract_prompts.py --check    # exit 1 when the shipped files differ from a fresh extraction
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import json
import platform
import re
import sys
import sysconfig
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from looped_spec.tuning import prompt_sets  # noqa: E402
from looped_spec.tuning.prompt_sets import (  # noqa: E402
    DATA_FOLDER,
    MAX_FILE_BYTES,
    MIN_SNIPPET_CHARS,
    SNIPPET_CHARS,
    file_snippets,
    near_duplicate_key,
    prompt_group,
)

OUT = ROOT / "looped_spec" / "tuning" / DATA_FOLDER
COUNT = 64  # snippets per group (a B = 32 phase plus rotation has room; 64 random-token prompts likewise)
CODE_FILES = 32
CODE_PER_FILE = 2
PROSE_PER_TOPIC = 2
SIMILAR = 0.25  # two snippets sharing this share (Jaccard) of their SHINGLE-token runs are near copies
SHINGLE = 4
TOKEN = re.compile(r"\w+|[^\w\s]")
MIN_WORDS = 12
CODE_SKIP_DIRS = frozenset({"_vendor", "testing", "test", "tests", "third_party", "__pycache__"})
LICENCE_WORDS = re.compile(r"copyright|licen[cs]", re.IGNORECASE)
PROSE_MARKERS = ("* ", "- ", "+", "|", "=", ">>>", "...", "[", "(", "Changed in version", "New in version",
                 "Added in version", "Deprecated since", "See also")  # fmt: skip
HYPHEN_BREAK = re.compile(r"([A-Za-z]-)\n(?=[A-Za-z])")  # "built-\nin": a word wrapped at its hyphen
UNDERLINE = re.compile(r"^([*=\-~^\"'#+])\1{2,}\s*$")
PROSE_CHARS = re.compile(r"[A-Za-z \u2018\u2019\u201c\u201d.,;:'\"()\-]")


CODE_RULE = (
    "Snippets of torch's installed Python sources (torch/**/*.py of the torch in this environment). Files under "
    "_vendor, testing, test, tests or third_party folders, over 100 KB, not UTF-8, or mentioning a copyright or "
    "licence (vendored or separately licensed code, licence headers) are skipped. The rest are taken in the order "
    f"of the SHA-256 of their path ('torch/...'); each gives up to {CODE_PER_FILE} snippets by the standard-library "
    "rule (looped_spec.tuning.prompt_sets.file_snippets: start at a def line, dedent, cut to 300 characters, strip "
    f"trailing whitespace, keep >= 80 characters; spread over the file's defs), until {CODE_FILES} files gave one. "
    "Snippets are interleaved round-robin across the files, so the first B come from B different files."
)
PROSE_RULE = (
    "English paragraphs of the Python reference documentation in pydoc_data/topics.py. Each documentation "
    "topic's text is split at blank lines; a paragraph is kept when none of its lines is indented (indented "
    "blocks are code examples, grammar productions, nested lists and tables), it starts with no list, table, "
    "prompt or bracket marker and is no version note or 'See also', holds no heading underline or '::=', does not "
    "end in a colon (it introduces a code block or a list), is at least 90 % letters, spaces and ordinary "
    f"punctuation and has at least {MIN_WORDS} words. Its lines are joined with single spaces (a word wrapped at "
    "its hyphen is joined again) and it is cut at a word boundary to <= 300 characters (>= 80 kept). Topics are "
    f"taken in the order of the SHA-256 of their name, up to {PROSE_PER_TOPIC} paragraphs each (spread over the "
    "topic), interleaved round-robin across topics, so the first B come from B different topics."
)
COMMON_RULE = (
    "A snippet is dropped when it occurs in the 'tune' or 'eval' group, repeats a kept one up to string literals "
    f"and numbers, or is a near copy of one (the Jaccard similarity of their runs of {SHINGLE} tokens >= {SIMILAR}); "
    f"the group is cut to {COUNT} snippets."
)


# ------------------------------------------------------------------------------------------ shared
def sha(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()


def spread(items: Sequence[Any], limit: int) -> list[Any]:
    """Up to `limit` of `items`, spread evenly (as `file_snippets` spreads over a file's defs)."""
    if len(items) <= limit:
        return list(items)
    return [items[j * len(items) // limit] for j in range(limit)]


def round_robin(per_source: list[list[Any]], count: int) -> list[Any]:
    """Item j of every source in turn, then item j + 1 ...; the first `count`."""
    out: list[Any] = []
    for j in range(max((len(s) for s in per_source), default=0)):
        out.extend(s[j] for s in per_source if j < len(s))
    return out[:count]


def shingles(text: str) -> frozenset[tuple[str, ...]]:
    """The text's runs of `SHINGLE` consecutive tokens (words, numbers, single punctuation marks)."""
    tokens = TOKEN.findall(text)
    return frozenset(tuple(tokens[i : i + SHINGLE]) for i in range(max(len(tokens) - SHINGLE + 1, 1)))


def similar(a: frozenset, b: frozenset) -> bool:
    """Near copies: the Jaccard similarity of two texts' shingles is at least `SIMILAR`."""
    return len(a & b) >= SIMILAR * len(a | b)


class Taken:
    """The texts kept so far; `fresh` refuses a text of the tuning / eval groups, a repeat up to literals and
    numbers, or a near copy of a kept text."""

    def __init__(self, banned: set[str]) -> None:
        self.banned, self.keys, self.kept = banned, set(), []

    def fresh(self, text: str) -> bool:
        key, grams = near_duplicate_key(text), shingles(text)
        if text in self.banned or key in self.keys or any(similar(grams, other) for other in self.kept):
            return False
        self.keys.add(key)
        self.kept.append(grams)
        return True


def cut_words(text: str, chars: int = SNIPPET_CHARS) -> str:
    """`text` cut at a word boundary to at most `chars` characters, trailing whitespace stripped."""
    text = text.strip()
    if len(text) <= chars:
        return text
    cut = text[: chars + 1]
    space = cut.rfind(" ")
    return (cut[:space] if space > 0 else text[:chars]).rstrip()


# ------------------------------------------------------------------------------------------ code
def torch_sources() -> tuple[Path, str, Path]:
    """(site-packages folder holding torch/, torch's version, its licence file)."""
    dist = importlib.metadata.distribution("torch")
    licence = next(f for f in dist.files or [] if f.name == "LICENSE" and "licenses" in f.parts)
    import torch

    return Path(torch.__file__).resolve().parent.parent, dist.version, Path(dist.locate_file(licence))


def code_files(site: Path) -> Iterator[tuple[str, str]]:
    """(path 'torch/...', text) of the usable torch source files, in the order of the SHA-256 of the path (read
    lazily: the extraction stops after `CODE_FILES` files)."""
    paths = {path.relative_to(site).as_posix(): path for path in (site / "torch").rglob("*.py")}
    for rel in sorted(paths, key=sha):
        path = paths[rel]
        if CODE_SKIP_DIRS & set(Path(rel).parts[:-1]):
            continue
        size = path.stat().st_size
        if size == 0 or size > MAX_FILE_BYTES:
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if LICENCE_WORDS.search(text):
            continue  # vendored or separately licensed code, or a licence header: not ours to judge
        yield rel, text


def extract_code(site: Path, banned: set[str]) -> list[dict[str, str]]:
    taken, per_file = Taken(banned), []
    for rel, text in code_files(site):
        snippets = [{"text": s, "source": rel} for s in file_snippets(text, limit=CODE_PER_FILE) if taken.fresh(s)]
        if snippets:
            per_file.append(snippets)
        if len(per_file) == CODE_FILES:
            break
    return round_robin(per_file, COUNT)


# ------------------------------------------------------------------------------------------ prose
def is_prose(lines: list[str]) -> bool:
    if not lines or any(line[:1].isspace() for line in lines):
        return False
    if lines[0].startswith(PROSE_MARKERS) or any(UNDERLINE.match(line) or "::=" in line for line in lines):
        return False
    text = " ".join(lines)
    letters = len(PROSE_CHARS.findall(text))
    return letters >= 0.9 * len(text) and len(text.split()) >= MIN_WORDS


def topic_paragraphs(text: str) -> list[str]:
    """The prose paragraphs of one documentation topic, reflowed and cut (`cut_words`)."""
    out = []
    for block in re.split(r"\n[ \t]*\n", text):
        lines = [line.rstrip() for line in block.split("\n") if line.strip()]
        if is_prose(lines) and not lines[-1].endswith(":"):
            paragraph = cut_words(" ".join(HYPHEN_BREAK.sub(r"\1", "\n".join(lines)).split()))
            if len(paragraph) >= MIN_SNIPPET_CHARS:
                out.append(paragraph)
    return out


def extract_prose(topics: dict[str, str], banned: set[str]) -> list[dict[str, str]]:
    taken, per_topic = Taken(banned), []
    for name in sorted(topics, key=sha):
        paragraphs = [p for p in spread(topic_paragraphs(topics[name]), PROSE_PER_TOPIC) if taken.fresh(p)]
        if paragraphs:
            per_topic.append([{"text": p, "source": f"pydoc_data/topics.py:{name}"} for p in paragraphs])
    return round_robin(per_topic, COUNT)


def psf_licence(stdlib: Path) -> tuple[str, str]:
    """(the PSF License Agreement's text, the copyright notice it asks to retain) from the stdlib's LICENSE.txt."""
    text = (stdlib / "LICENSE.txt").read_text(encoding="utf-8")
    start = text.index("PYTHON SOFTWARE FOUNDATION LICENSE VERSION 2")
    end = text.index("BEOPEN.COM LICENSE AGREEMENT", start)
    agreement = text[start:end].strip().rstrip("-").strip()
    found = re.search(r'"(Copyright \(c\) [^"]*Python Software Foundation;\s*All\s+Rights\s+Reserved)"', agreement)
    if found is None:
        raise SystemExit("LICENSE.txt: no PSF copyright notice found")
    return agreement, " ".join(found.group(1).split())


# ------------------------------------------------------------------------------------------ main
def build() -> dict[str, dict[str, Any]]:
    banned = set(prompt_group("tune")) | set(prompt_group("eval"))
    site, torch_version, torch_licence = torch_sources()
    licence_text = torch_licence.read_text(encoding="utf-8")
    copyright_lines = [line.strip() for line in licence_text.splitlines() if line.strip().startswith("Copyright")]
    code = extract_code(site, banned)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    from pydoc_data import topics as pydoc_topics

    agreement, psf_copyright = psf_licence(stdlib)
    prose = extract_prose(pydoc_topics.topics, banned)
    common = {"generated_by": "scripts/extract_prompts.py", "python": platform.python_version()}
    return {
        "code": {
            "group": "code",
            "description": f"{len(code)} Python snippets of torch {torch_version}'s own sources (another project's "
            "code: the tiny models trained on the standard library and HumanEval only)",
            "source": {
                "package": "torch",
                "version": torch_version,
                "files": sorted({s["source"] for s in code}),
                "root": "torch/**/*.py as installed (site-packages)",
                "url": "https://github.com/pytorch/pytorch",
            },
            "licence": {
                "name": "BSD-3-Clause",
                "copyright": copyright_lines,
                "file": f"torch-{torch_version}.dist-info/licenses/LICENSE",
                "text": licence_text,
            },
            "rule": f"{CODE_RULE} {COMMON_RULE}",
            **common,
            "snippets": code,
        },
        "prose": {
            "group": "prose",
            "description": f"{len(prose)} English paragraphs of the Python {platform.python_version()} reference "
            "documentation (pydoc_data/topics.py, 740 KB: over the tiny models' 100 KB training-file limit)",
            "source": {
                "package": "CPython",
                "version": platform.python_version(),
                "files": ["pydoc_data/topics.py"],
                "root": "the standard library (sysconfig stdlib path)",
                "url": "https://docs.python.org/3.11/reference/",
            },
            "licence": {
                "name": "PSF-2.0",
                "copyright": [psf_copyright],
                "file": "LICENSE.txt of the standard library",
                "text": agreement,
            },
            "rule": f"{PROSE_RULE} {COMMON_RULE}",
            **common,
            "snippets": prose,
        },
    }


def dump(data: dict[str, Any]) -> str:
    return json.dumps(data, indent=1, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None, out: Path = OUT, report: Callable[[str], None] = print) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="compare with the shipped files; write nothing")
    args = parser.parse_args(argv)
    groups = build()
    differ = []
    for name, data in groups.items():
        text = dump(data)
        prompt_sets.validate_prompt_data(json.loads(text), name)
        path = out / f"{name}.json"
        files = len(data["source"]["files"])
        summary = f"{name}: {len(data['snippets'])} snippets from {files} file(s) / topic(s), {len(text)} bytes"
        if args.check:
            same = path.is_file() and path.read_text(encoding="utf-8") == text
            differ += [] if same else [name]
            report(f"{summary}: {'same as' if same else 'DIFFERS from'} {path}")
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text, encoding="utf-8")
            report(f"{summary}: wrote {path}")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
