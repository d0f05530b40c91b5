"""The property tests' examples (derandomized, no example database) do not depend on what ran before them in the
process: a module imported meanwhile whose literals Hypothesis would draw from (its "local constants", pinned by
conftest to the package's) changes none of the examples drawn."""

from __future__ import annotations

import importlib
import sys

from hypothesis import given, settings
from hypothesis import strategies as st


def drawn() -> list:
    """The examples one derandomized test draws (its name and source, hence its seed, the same at every call)."""
    seen = []

    @settings(max_examples=200, derandomize=True, database=None)
    @given(st.lists(st.integers(0, 2**31 - 1), max_size=6), st.floats(0, 1), st.text(max_size=4))
    def draw(ints, fraction, text):
        seen.append((ints, fraction, text))

    draw()
    return seen


def test_a_module_imported_between_two_runs_changes_no_example(tmp_path, monkeypatch):
    before = drawn()
    # a local module (not site-packages, not stdlib) whose literals Hypothesis would otherwise add to what it draws
    literals = [str(1000 + 7919 * i) for i in range(300)] + [f"0.{i:03d}7" for i in range(100)]
    literals += [repr(f"w{i}") for i in range(100)]
    (tmp_path / "module_of_many_literals.py").write_text(f"LITERALS = [{', '.join(literals)}]\n")
    monkeypatch.syspath_prepend(tmp_path)
    try:
        importlib.import_module("module_of_many_literals")
        assert drawn() == before
    finally:
        sys.modules.pop("module_of_many_literals", None)
