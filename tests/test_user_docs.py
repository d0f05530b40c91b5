"""The user docs (README.md, docs/usage.md, docs/serving.md) stay true to the code: every command line they show
parses with its subcommand's flags, every flag they name exists, every file, module and section they point at
exists, and the README's Python example runs."""

from __future__ import annotations

import ast
import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from looped_spec.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
USER_DOCS = ["README.md", "docs/usage.md", "docs/serving.md"]
#: Flags of other tools the docs show (pip, huggingface_hub's `hf`, pytest-xdist): not ours to check
FOREIGN_FLAGS = {"--index-url", "--local-dir", "--maxprocesses"}
#: The benchmark scripts whose command lines the docs show
SCRIPTS = ["bench_speculative", "bench_server"]
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def _text(doc: str) -> str:
    return (ROOT / doc).read_text()


def _shell_lines(doc: str) -> list[str]:
    """The command lines of the doc's ```bash blocks, continuation lines joined."""
    blocks = re.findall(r"```bash\n(.*?)```", _text(doc), re.S)
    return [line for block in blocks for line in block.replace("\\\n", " ").splitlines() if line.strip()]


def _subcommand_flags() -> dict[str, set[str]]:
    parser = build_parser()
    subparsers = next(a for a in parser._actions if a.choices and "generate" in a.choices)
    return {name: {s for a in sub._actions for s in a.option_strings} for name, sub in subparsers.choices.items()}


@pytest.fixture(scope="module")
def script_flags() -> dict[str, set[str]]:
    """Each benchmark script's flags, read from its --help (the scripts build their parser inside main)."""
    flags = {}
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    for script in SCRIPTS:
        done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / f"{script}.py"), "--help"],
                              capture_output=True, text=True, timeout=120, env=env)  # fmt: skip
        assert done.returncode == 0, done.stderr
        flags[script] = set(FLAG.findall(done.stdout))
    return flags


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_looped_spec_command_line_parses(doc):
    """A command the docs show is one argparse takes: known flags, valid choices, a value where one is needed."""
    parser = build_parser()
    commands = [line for line in _shell_lines(doc) if line.startswith("looped-spec ")]
    for line in commands:
        argv = shlex.split(line, comments=True)[1:]
        try:
            parser.parse_args(argv)
        except SystemExit as exc:
            pytest.fail(f"{doc}: `{line.strip()}` does not parse (exit {exc.code})")
    assert commands or doc == "docs/usage.md", f"{doc} shows no looped-spec command any more: update this test"


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_benchmark_command_line_uses_its_flags(doc, script_flags):
    for line in _shell_lines(doc):
        match = re.match(r"python benchmarks/(\w+)\.py", line)
        if match:
            unknown = set(FLAG.findall(line.split("#")[0])) - script_flags[match.group(1)]
            assert not unknown, f"{doc}: `{line.strip()}`: {sorted(unknown)} not in {match.group(1)}.py --help"


def _vllm_flags() -> set[str]:
    """vLLM's flags the command line answers with what stands for each (the docs name them as vLLM's)."""
    from looped_spec.cli.flag_errors import VLLM_SERVE_FLAGS
    from looped_spec.engine.config import VLLM_OPTIONS

    return {"--" + name.replace("_", "-") for name in [*VLLM_OPTIONS, *VLLM_SERVE_FLAGS]}


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_flag_named_exists(doc, script_flags):
    """Prose names flags without saying whose: each must be a flag of a subcommand or of a benchmark script, or one of
    vLLM's the command line tells what stands for."""
    known = set().union(*_subcommand_flags().values(), *script_flags.values(), FOREIGN_FLAGS, _vllm_flags())
    unknown = sorted(set(FLAG.findall(_text(doc))) - known)
    assert not unknown, f"{doc} names flags no command has: {unknown}"


def _sections(doc: str) -> list[str]:
    """A doc's headings and the bold lead-ins of its paragraphs (`**Prices on another machine.**`)."""
    text = _text(doc)
    headings = [re.sub(r"^#+\s*", "", h).strip() for h in re.findall(r"^#+ .*$", text, re.M)]
    return headings + [b.rstrip(".") for b in re.findall(r"\*\*([^*]+)\*\*", text)]


def _references(doc: str) -> list[tuple[str, str]]:
    """(target doc, section) for each `docs/x.md, "Section"`, `README, "Section"` and `("Section")` in the doc."""
    text = re.sub(r"\s+", " ", _text(doc))
    refs = []
    for match in re.finditer(r"`?(docs/\w+\.md|README)`?,? (\"[^\"]+\"(?:(?:, | and )\"[^\"]+\")*)", text):
        target = "README.md" if match.group(1) == "README" else match.group(1)
        refs += [(target, name) for name in re.findall(r'"([^"]+)"', match.group(2))]
    refs += [(doc, name) for name in re.findall(r'\("([A-Z][^"]+)"[;)]', text)]
    return refs


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_section_referred_to_exists(doc):
    refs = _references(doc)
    assert refs, f"{doc}: no cross-reference found: update this test's patterns"
    missing = [
        (target, name)
        for target, name in refs
        if not any(section.startswith(name) for section in _sections(target))
        and not (target == "README.md" and any(section.startswith(name) for section in _sections(doc)))
    ]
    assert not missing, f"{doc} refers to sections that do not exist: {missing}"


@pytest.mark.parametrize("doc", USER_DOCS)
def test_every_path_and_module_named_exists(doc):
    text = _text(doc)
    paths = set(re.findall(r"(?<![\w/~.-])((?:docs|examples|benchmarks|tests|scripts|presets|looped_spec)/[\w./-]*\w)",
                           text))  # fmt: skip
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"{doc} names paths that do not exist: {missing}"
    for dotted in set(re.findall(r"\blooped_spec(?:\.\w+)+", text)):
        assert _resolves(dotted), f"{doc} names {dotted}, which does not exist"


def _resolves(dotted: str) -> bool:
    """A module, or a name defined at the top of one, found without importing it (some import Ray)."""
    parts = dotted.split(".")
    for depth in range(1, len(parts) + 1):  # down the packages: find_spec imports the parents it is given
        spec = importlib.util.find_spec(".".join(parts[:depth]))
        if spec is None:
            return False
        if depth == len(parts):
            return True
        if spec.submodule_search_locations is None:  # a module: the rest is a name it defines
            break
    else:
        return True
    tree = ast.parse(Path(spec.origin).read_text())
    defined = {node.name for node in tree.body if isinstance(node, (ast.ClassDef, ast.FunctionDef))}
    defined |= {
        t.id for node in tree.body if isinstance(node, ast.Assign) for t in node.targets if isinstance(t, ast.Name)
    }
    return depth == len(parts) - 1 and parts[-1] in defined


def test_readme_python_example_runs(tmp_path):
    """The README's "Use" example, as printed there, on the shipped tiny model."""
    use = _text("README.md").split("## Use", 1)[1]
    code = re.search(r"```python\n(.*?)```", use, re.S).group(1)
    env = os.environ | {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env,
                          cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert "'controller': 'adaptive'" in done.stdout, done.stdout[-2000:]


def test_readme_layout_lists_every_unit_of_the_package():
    """The README's layout names each folder and top-level module of looped_spec/."""
    layout = re.search(r"## Layout\n.*?```\n(.*?)```", _text("README.md"), re.S).group(1)
    package = ROOT / "looped_spec"
    units = {p.name + "/" for p in package.iterdir() if p.is_dir() and not p.is_symlink() and p.name != "__pycache__"}
    units |= {p.name for p in package.glob("*.py") if p.name != "__init__.py"}
    listed = set(re.findall(r"^  (\w+/)", layout, re.M)) | set(re.findall(r"\b(\w+\.py)\b", layout.split("\n")[1]))
    assert units == listed, f"README layout: missing {sorted(units - listed)}, gone {sorted(listed - units)}"
