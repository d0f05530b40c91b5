"""The package's folders follow the data path (docs/architecture.md, "The data path"): each imports only from the
folders before it, and the control plane is pure logic on numbers (no torch, no model code)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import looped_spec

PACKAGE = Path(looped_spec.__file__).resolve().parent
#: The folders (and top-level modules) in data-path order; a unit may import its own and earlier ones only
ORDER = [
    {"request", "sampling_params", "detokenizer", "token_bytes", "structured_output", "reasoning", "logs"},
    {"presets"},
    {"models"},
    {"adapters", "execution"},
    {"speculative", "control"},
    {"loop_batching"},
    {"engine"},
    {"tuning"},
    {"server"},
    {"cli"},
]
RANK = {unit: rank for rank, units in enumerate(ORDER) for unit in units}
#: The one import against the order: the adapter registry loads the built-in families on its first lookup
#: (they register themselves by subclassing the base it defines)
ALLOWED = {("models/adapter.py", "looped_spec.adapters")}


def _unit(path: Path) -> str:
    relative = path.relative_to(PACKAGE)
    return relative.parts[0].removesuffix(".py")


def _imports(path: Path) -> set[str]:
    """Every module `path` imports (at the top or inside functions), as dotted names."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


def _sources() -> list[Path]:
    files = [p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts]
    # adapters/ and presets/ are linked into the package in the source tree (installed as subpackages)
    for linked in ("adapters", "presets"):
        files += [PACKAGE / linked / p.name for p in (PACKAGE / linked).resolve().glob("*.py")]
    return sorted(set(files))


def test_every_unit_has_a_place_in_the_order():
    units = {_unit(p) for p in _sources()} - {"__init__"}
    assert units <= set(RANK), f"not in ORDER: {sorted(units - set(RANK))}"


def test_folders_import_only_from_those_before_them():
    back = []
    for path in _sources():
        unit = _unit(path)
        if unit == "__init__":
            continue  # the package's face hands every public name on, lazily
        for name in _imports(path):
            parts = name.split(".")
            if parts[0] != "looped_spec" or len(parts) < 2:
                continue
            if RANK[parts[1]] > RANK[unit] and (str(path.relative_to(PACKAGE)), name) not in ALLOWED:
                back.append(f"{path.relative_to(PACKAGE)} imports {name}")
    assert not back, "imports against the data path:\n" + "\n".join(back)


def test_control_and_presets_import_no_torch_and_no_model_code():
    for path in _sources():
        if _unit(path) not in ("control", "presets"):
            continue
        for name in _imports(path):
            parts = name.split(".")
            assert parts[0] != "torch", f"{path.relative_to(PACKAGE)} imports torch"
            if parts[0] == "looped_spec" and len(parts) > 1:
                assert parts[1] in ("control", "presets"), f"{path.relative_to(PACKAGE)} imports {name}"


def test_every_subpackage_is_installed():
    """pyproject lists the packages setuptools installs: a folder missing there works from the source tree (an
    editable install) and is absent from a wheel."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the project supports 3.10, where it is absent)
    root = PACKAGE.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]["packages"])
    folders = {
        "looped_spec." + ".".join(p.parent.relative_to(PACKAGE).parts) if p.parent != PACKAGE else "looped_spec"
        for p in PACKAGE.rglob("__init__.py")
        if "__pycache__" not in p.parts
    }
    assert folders <= listed, f"not in pyproject's packages: {sorted(folders - listed)}"
