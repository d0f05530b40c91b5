"""scripts/train_gate.py: gate-only training changes the exit gate and nothing else, reproducibly, and its
objective and evaluation use the adapter's own exit rule (on the random-weight Ouro fixture)."""

from __future__ import annotations

import hashlib
import importlib.util
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import fixture_dir
from safetensors.torch import load_file

from looped_spec import load_adapter

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def tg():
    spec = importlib.util.spec_from_file_location("train_gate", ROOT / "scripts" / "train_gate.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("train_gate", module)
    spec.loader.exec_module(module)
    return module


def small_run(tg, init: Path, out: Path | None):
    args = tg.parse_args(["--dry-run", "--steps", "40", "--windows", "6", "--val-windows", "2", "--seq-len", "24"])
    args.batch = 256
    gen = torch.Generator().manual_seed(7)
    train, heldout = torch.randint(1, 256, (6000,), generator=gen), torch.randint(1, 256, (4000,), generator=gen)
    windows = tg.split_windows(train, heldout, args)
    assert windows["train"].shape == (6, 25) and windows["held-out"].shape == (128, 25)
    return tg.run(init, out, windows, args)


def test_only_the_gate_changes_bit_for_bit_and_reproducibly(tg, tmp_path, capsys):
    init = tmp_path / "init"
    shutil.copytree(fixture_dir("ouro"), init)
    before = load_file(str(init / "model.safetensors"))
    small_run(tg, init, tmp_path / "a")
    small_run(tg, init, tmp_path / "b")
    printed = capsys.readouterr().out
    assert "| τ | input gate: mean depth" in printed and "fixed depths mixed" in printed and "bit-identical" in printed
    after = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert tg.only_gate_differs(before, after) == sorted(tg.GATE_TENSORS)
    for name in before:
        if name not in tg.GATE_TENSORS:
            assert torch.equal(before[name], after[name]), name
    digest = [hashlib.sha256((tmp_path / x / "model.safetensors").read_bytes()).hexdigest() for x in "ab"]
    assert digest[0] == digest[1]  # seeded: the same gate, bit for bit
    assert (tmp_path / "a" / "config.json").read_bytes() == (init / "config.json").read_bytes()
    ids = torch.randint(1, 256, (1, 12))
    old, new = load_adapter(init, dtype="float32"), load_adapter(tmp_path / "a", dtype="float32")
    assert torch.equal(old.dense_logits(ids), new.dense_logits(ids))  # full-depth output unchanged


def test_refuses_to_write_unless_only_the_gate_differs(tg, tmp_path, monkeypatch):
    init = fixture_dir("ouro")
    tensors = load_file(str(init / "model.safetensors"))
    name = next(n for n in sorted(tensors) if n not in tg.GATE_TENSORS)
    changed = {**tensors, name: tensors[name].clone()}
    changed[name].view(-1)[0] += 1e-7 * max(1.0, abs(float(changed[name].view(-1)[0])))
    with pytest.raises(RuntimeError, match="not bit-identical"):
        tg.only_gate_differs(tensors, changed)
    weight, bias = torch.ones(tensors[tg.GATE_TENSORS[0]].shape), torch.ones(1)
    save_file = tg.save_file

    def tampering_save(data, path, metadata=None):  # a write that alters a language-model tensor
        save_file({**data, name: data[name] + 1}, path, metadata=metadata)

    monkeypatch.setattr(tg, "save_file", tampering_save)
    out = tmp_path / "out"
    with pytest.raises(RuntimeError, match="not bit-identical"):
        tg.write_gate(init, out, weight, bias)
    assert not (out / "model.safetensors").exists() and not list(out.glob("*.tmp"))
    monkeypatch.setattr(tg, "save_file", save_file)
    assert tg.write_gate(init, out, weight, bias) == sorted(tg.GATE_TENSORS)


def test_rule_depths_follow_exit_pdf_and_the_objective_is_the_rules_quantity(tg):
    adapter = load_adapter(fixture_dir("ouro"), dtype="float32")
    windows = torch.randint(1, 256, (4, 17), generator=torch.Generator().manual_seed(3))
    feats = tg.frozen_features(adapter, windows)
    depth = adapter.full_depth
    gates = torch.stack([adapter.exit_signal(feats.states[:, s], s + 1) for s in range(depth)], -1)
    assert torch.equal(gates, tg.gate_logits(feats.states, *(adapter.weights[n] for n in tg.GATE_TENSORS)))
    cdf = torch.cumsum(adapter.exit_pdf(gates).double(), -1)
    for tau in (0.2, 0.5, 0.8):
        hits = cdf[:, :-1] >= tau
        want = torch.where(hits.any(1), hits.float().argmax(1) + 1, torch.full((len(cdf),), depth))
        assert torch.equal(tg.rule_depths(adapter, feats.states, tau), want)
    # "cumulative": a binary cross-entropy of the rule's cumulative exit probability cdf_s against agreement
    agree = feats.agrees()[:, :-1].double()
    naive = F.binary_cross_entropy(cdf[:, :-1], agree)
    assert abs(tg.gate_loss("cumulative", gates, feats.top, feats.nll).item() - naive.item()) < 1e-5


def test_model_card_section_is_replaced_not_repeated(tg, tmp_path):
    card = tmp_path / "README.md"
    card.write_text("# m\n\n## Held-out evaluation\n\nnumbers\n\n## Sample (greedy, full depth)\n\ntext\n")
    for version in ("first", "second"):
        tg.update_card(tmp_path, f"{tg.CARD_HEADING}\n\n{version} gate\n\n")
    text = card.read_text()
    assert text.count(tg.CARD_HEADING) == 1 and "second gate" in text and "first gate" not in text
    assert text.index("## Held-out evaluation") < text.index(tg.CARD_HEADING) < text.index("## Sample")
    assert text.endswith("## Sample (greedy, full depth)\n\ntext\n") and "\n\n\n" not in text
