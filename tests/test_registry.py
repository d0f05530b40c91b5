"""A user-defined looped family (examples/custom_family.py), registered and run end to end through the public API."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))
from custom_family import ToyLoopedAdapter, make_toy_checkpoint  # noqa: E402

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig, load_adapter  # noqa: E402


def test_user_family_end_to_end(tmp_path):
    folder = make_toy_checkpoint(tmp_path / "toy")
    adapter = load_adapter(folder, dtype="float32", device="cpu")
    assert isinstance(adapter, ToyLoopedAdapter) and adapter.full_depth == 3
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation="off").generate(prompt, params)[0]
    # the plain output equals a naive dense loop
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(adapter.dense_logits(torch.tensor(seq))[0, -1].argmax()))
    assert plain.token_ids == seq[len(prompt) :]
    spec = LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation=SpeculativeConfig(k=3, d=2))
    assert spec.generate(prompt, params)[0].token_ids == plain.token_ids
    adaptive = LoopedSpecEngine(folder, dtype="float32", device="cpu")  # the default: the generic preset at D=3
    assert adaptive.generate(prompt, params)[0].token_ids == plain.token_ids
