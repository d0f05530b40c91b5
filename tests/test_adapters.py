"""Exactness of the three families against the reference code's outputs (fixtures)."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, load, reference, reference_tensors
from safetensors.torch import save_file

from looped_spec.execution.attention import build_paged_context
from looped_spec.execution.kv_cache import KVCache


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out - ref).abs().max() / ref.abs().max())


@pytest.mark.parametrize("family", FAMILIES)
def test_dense_logits_match_reference_at_every_depth(family):
    adapter, ref, tensors = load(family), reference(family), reference_tensors(family)
    assert adapter.full_depth == ref["full_depth"]
    for i, prompt in enumerate(ref["prompts"]):
        for depth in ref["depths"]:
            out = adapter.dense_logits(torch.tensor(prompt), depth)[0]
            assert rel_err(out, tensors[f"logits.p{i}.depth{depth}"]) <= 1e-4, (family, i, depth)


def test_dense_logits_batched_equals_single():
    adapter = load("ouro")
    prompts = torch.tensor([reference("ouro")["prompts"][1][:7], reference("ouro")["prompts"][0]])
    batched = adapter.dense_logits(prompts, 3)
    for b in range(2):
        assert torch.allclose(batched[b], adapter.dense_logits(prompts[b], 3)[0], atol=1e-5)


def test_ouro_gate_logits_and_exit_pdf():
    adapter, ref, tensors = load("ouro"), reference("ouro"), reference_tensors("ouro")
    from looped_spec.models.dense import DenseContext

    for i, prompt in enumerate(ref["prompts"]):
        ids = torch.tensor(prompt)
        ctx = DenseContext(1, len(prompt), torch.arange(len(prompt)))
        state = adapter.embed(ids, ctx)
        gates = []
        for step in range(adapter.full_depth):
            state = adapter.loop(state, step, ctx)
            gates.append(adapter.exit_signal(state, step + 1))
        gates = torch.stack(gates, dim=-1)
        assert rel_err(gates, tensors[f"gate_logits.p{i}"]) <= 1e-4
        assert rel_err(adapter.exit_pdf(gates), tensors[f"exit_pdf.p{i}"]) <= 1e-4


def test_huginn_explicit_initial_state():
    adapter, ref, tensors = load("huginn"), reference("huginn"), reference_tensors("huginn")
    depth = ref["full_depth"]
    out = adapter.dense_logits(torch.tensor(ref["prompts"][0]), depth, initial_state=tensors["initial_state.p0"])
    assert rel_err(out[0], tensors[f"logits_from_state.p0.depth{depth}"]) <= 1e-4


def test_huginn_random_initial_state_is_keyed_by_seed_and_position():
    from conftest import fixture_dir

    from looped_spec import load_adapter

    adapter = load_adapter(fixture_dir("huginn"), dtype="float32", device="cpu", initial_state="random")
    ids = torch.tensor(reference("huginn")["prompts"][0])
    a = adapter.dense_logits(ids, 4, seeds=[7])
    b = adapter.dense_logits(ids, 4, seeds=[7])
    c = adapter.dense_logits(ids, 4, seeds=[8])
    assert torch.equal(a, b) and not torch.allclose(a, c)
    # the same token position draws the same state inside a longer sequence
    longer = adapter.dense_logits(torch.cat([ids, ids[:3]]), 4, seeds=[7])
    assert torch.allclose(longer[0, : len(ids)], a[0], atol=1e-5)
    zeros = load("huginn").dense_logits(ids, 4)
    assert not torch.allclose(a, zeros)


def test_huginn_runs_past_mean_recurrence():
    adapter = load("huginn")
    out = adapter.dense_logits(torch.tensor([3, 4, 5]), adapter.full_depth + 4)
    assert torch.isfinite(out).all()


def incremental_logits(adapter, prompt: list[int], depth: int, chunk: int) -> torch.Tensor:
    """Run `prompt` through the paged cache in chunks at `depth` loops; logits at every position."""
    kv = KVCache(adapter.kv_layout, num_blocks=8, block_size=4, dtype=adapter.dtype, device="cpu")
    table: list[int] = []
    outs = []
    for start in range(0, len(prompt), chunk):
        piece = prompt[start : start + chunk]
        kv.grow(table, start + len(piece))
        ctx = build_paged_context(
            kv.key_cache,
            kv.value_cache,
            kv.block_size,
            [table],
            [start + len(piece)],
            [len(piece)],
            seeds=[0],
            need_token_seeds=adapter.needs_token_seeds,
        )
        state = adapter.embed(torch.tensor(piece), ctx)
        for i in range(depth):
            state = adapter.loop(state, i, ctx)
        outs.append(adapter.readout(state, depth, ctx))
    return torch.cat(outs)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("chunk", [1, 3, 100])
def test_incremental_with_kv_cache_equals_dense(family, chunk):
    adapter, ref = load(family), reference(family)
    prompt = ref["prompts"][1]
    for depth in ref["depths"]:
        dense = adapter.dense_logits(torch.tensor(prompt), depth)[0]
        inc = incremental_logits(adapter, prompt, depth, chunk)
        assert rel_err(inc, dense) <= 1e-5, (family, depth, chunk)


@pytest.mark.parametrize("family", FAMILIES)
def test_bfloat16_runs_and_mostly_agrees_with_fp32(family):
    ref = reference(family)
    fp32, bf16 = load(family), load(family, "bfloat16")
    agree = total = 0
    for prompt in ref["prompts"]:
        a = fp32.dense_logits(torch.tensor(prompt))[0]
        b = bf16.dense_logits(torch.tensor(prompt))[0]
        assert torch.isfinite(b).all()
        agree += int((a.argmax(-1) == b.argmax(-1)).sum())
        total += a.shape[0]
    assert agree / total >= 0.6, agree / total


class _Norm(torch.nn.Module):
    """transformers' final RMSNorm standing in a decoder-layer slot: the norm Nanbeige applies between loops."""

    def __init__(self, norm: torch.nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, hidden_states, *args, **kwargs):
        return self.norm(hidden_states)


@pytest.mark.parametrize("loops, skip_loop_final_norm", [(1, False), (3, False), (2, True)])
def test_nanbeige_equals_transformers_llama_run_loop_after_loop(tmp_path, loops, skip_loop_final_norm):
    """Nanbeige is Llama's layers run `num_loops` times with `model.norm` between loops (once, at the end, with
    skip_loop_final_norm): transformers' own LlamaForCausalLM with its layer list repeated is an independent reference
    for the norms, rotate-half RoPE, grouped-query attention with head_dim != hidden/heads, the SwiGLU MLP, a tied head
    and a transformers-5 config (rope_parameters)."""
    import json

    from transformers import LlamaConfig, LlamaForCausalLM

    from looped_spec import load_adapter

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=96,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=128,
        rope_parameters={"rope_type": "default", "rope_theta": 70000.0},
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():
        for p in model.parameters():  # norm weights around 1, matrices large enough that every piece shows
            p.copy_(torch.randn_like(p) * 0.3 if p.dim() > 1 else 1 + 0.2 * torch.randn_like(p))
    save_file({k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"},
              str(tmp_path / "model.safetensors"))  # fmt: skip
    fields = json.loads(config.to_json_string()) | {"model_type": "nanbeige", "num_loops": loops,
                                                    "skip_loop_final_norm": skip_loop_final_norm}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(fields))
    adapter = load_adapter(tmp_path, dtype="float32", device="cpu")

    layers = list(model.model.layers)
    between = [] if skip_loop_final_norm else [_Norm(model.model.norm)]
    model.model.layers = torch.nn.ModuleList(layers + (between + layers) * (loops - 1))
    model.config.num_hidden_layers = len(model.model.layers)
    ids = torch.randint(0, config.vocab_size, (2, 37))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits.float()  # no cache: a reused layer index would share its keys
    assert rel_err(adapter.dense_logits(ids), expected) <= 1e-5
