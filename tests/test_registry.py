"""A user-defined looped family, registered and run end to end through the public API."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from looped_spec import (
    KVLayout,
    LoopedSpecEngine,
    ModelAdapter,
    SamplingParams,
    SpeculativeConfig,
    TensorSpec,
    load_adapter,
    register_adapter,
)
from looped_spec.layers import memo_half_rope, rms_norm, self_attention


@register_adapter("toy_looped")
class ToyLoopedAdapter(ModelAdapter):
    """One attention layer + norm looped `loops` times; head reads the normed state."""

    @classmethod
    def tensor_specs(cls, config):
        d, v = config["hidden"], config["vocab_size"]
        return {
            "embed": TensorSpec((v, d)),
            "wq": TensorSpec((d, d)),
            "wk": TensorSpec((d, d)),
            "wv": TensorSpec((d, d)),
            "wo": TensorSpec((d, d)),
            "norm": TensorSpec((d,)),
            "head": TensorSpec((v, d)),
        }

    @property
    def full_depth(self):
        return self.config["loops"]

    @property
    def vocab_size(self):
        return self.config["vocab_size"]

    @property
    def state_dim(self):
        return self.config["hidden"]

    @property
    def kv_layout(self):
        return KVLayout(self.full_depth, 1, self.config["hidden"], self.full_depth, 0)

    @property
    def max_positions(self):
        return 256

    def embed(self, token_ids, ctx):
        return F.embedding(token_ids, self.weights["embed"])

    def loop(self, state, loop_index, ctx):
        w = self.weights
        d = self.config["hidden"]
        tables = memo_half_rope(ctx, d, 10000.0)
        attn = self_attention(
            rms_norm(state, w["norm"], 1e-6), w["wq"], w["wk"], w["wv"], w["wo"], 1, 1, d, tables, ctx, loop_index
        )
        return rms_norm(state + attn, w["norm"], 1e-6)

    def readout(self, state, depth, ctx):
        return F.linear(state, self.weights["head"]).float()


def make_toy_checkpoint(folder):
    folder.mkdir()
    config = {"model_type": "toy_looped", "hidden": 16, "vocab_size": 32, "loops": 3, "eos_token_id": 31}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s.shape, generator=gen) * 0.3 for n, s in ToyLoopedAdapter.tensor_specs(config).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def test_user_family_end_to_end(tmp_path):
    folder = make_toy_checkpoint(tmp_path / "toy")
    adapter = load_adapter(folder, dtype="float32", device="cpu")
    assert isinstance(adapter, ToyLoopedAdapter) and adapter.full_depth == 3
    prompt = [1, 2, 3, 4, 5]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = LoopedSpecEngine(folder, dtype="float32", device="cpu").generate(prompt, params)[0]
    # the plain output equals a naive dense loop
    seq = list(prompt)
    for _ in range(12):
        seq.append(int(adapter.dense_logits(torch.tensor(seq))[0, -1].argmax()))
    assert plain.token_ids == seq[len(prompt) :]
    spec = LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation=SpeculativeConfig(k=3, d=2))
    assert spec.generate(prompt, params)[0].token_ids == plain.token_ids
