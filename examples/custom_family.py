"""A new looped family, registered with `@register_adapter` and run end to end.

The toy family is one attention layer + RMSNorm looped `loops` times, with a linear head. A real
family subclasses `ModelAdapter` the same way (see docs/architecture.md): say how tensors are named
and shaped, the depth and KV layout, and what `embed`, `loop` and `readout` compute. The engine,
speculation and server then work unchanged. This file is also what tests/test_registry.py tests.

    python examples/custom_family.py --max-tokens 12
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

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
    register_adapter,
)
from looped_spec.models.layers import memo_half_rope, rms_norm, self_attention


@register_adapter("toy_looped")
class ToyLoopedAdapter(ModelAdapter):
    """One attention layer + norm looped `loops` times; head reads the normed state."""

    # every loop runs the same weights on its own KV plane, and the head ignores the depth: one captured loop serves
    # every loop (the engine checks the claim when it starts)
    uniform_loops = True

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
        # one plane per loop (one layer), one KV head as wide as the state
        depth = self.full_depth
        return KVLayout(num_planes=depth, num_kv_heads=1, head_dim=self.config["hidden"], num_loop_planes=depth)

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


def make_toy_checkpoint(folder: Path) -> Path:
    """A random-weight toy checkpoint (config.json + model.safetensors) in a new `folder`."""
    folder.mkdir()
    config = {"model_type": "toy_looped", "hidden": 16, "vocab_size": 32, "loops": 3, "eos_token_id": 31}
    (folder / "config.json").write_text(json.dumps(config))
    gen = torch.Generator().manual_seed(0)
    tensors = {n: torch.randn(s.shape, generator=gen) * 0.3 for n, s in ToyLoopedAdapter.tensor_specs(config).items()}
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--max-tokens", type=int, default=12)
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_toy_checkpoint(Path(tmp) / "toy")  # config.json says model_type "toy_looped"
        params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)
        prompt = [1, 2, 3, 4, 5]  # the toy has no tokenizer: token ids in, token ids out
        plain = LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation="off")
        spec = LoopedSpecEngine(folder, dtype="float32", device="cpu", speculation=SpeculativeConfig(k=3, d=2))
        plain_ids = plain.generate(prompt, params)[0].token_ids
        spec_ids = spec.generate(prompt, params)[0].token_ids
        print(f"plain:       {plain_ids}\nspeculative: {spec_ids}")
        print(f"draft tokens accepted: {spec.stats.num_accepted_tokens}/{spec.stats.num_draft_tokens}")
        assert spec_ids == plain_ids, "greedy speculative output must equal plain decoding"


if __name__ == "__main__":
    main()
