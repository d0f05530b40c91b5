"""Huginn at test-time depths: its `num_steps` sets the loop depth D when the model is loaded, and the preset, tuned at
another depth, is fitted to it (schema.py `for_depth`). Adaptive speculation must start, speculate and stay lossless
(greedy output token for token that of plain decoding) at every depth.
"""

from __future__ import annotations

import logging

import pytest
import torch
from conftest import fixture_dir

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.control import AdaptiveController
from looped_spec.tuning.prompt_sets import prompt_group

PARAMS = SamplingParams(max_tokens=24, temperature=0.0)
PRESET_LOGGER = "looped_spec.presets.lookup"
TUNED_AT = 8  # the shipped tiny-huginn preset's full_depth


def engine(model, n: int, speculation, **options) -> LoopedSpecEngine:
    return LoopedSpecEngine(
        model, adapter_options={"num_steps": n}, speculation=speculation, max_batch_size=4, dtype="float32", **options
    )


def fitting_notes(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == PRESET_LOGGER and "measured at depth" in r.message]


@pytest.mark.parametrize("n", [4, 8, 12, 16])
def test_tiny_huginn_speculates_losslessly_at_any_num_steps(n, caplog):
    prompts = prompt_group("code", 3)
    caplog.set_level(logging.INFO, logger=PRESET_LOGGER)
    adaptive = engine("tiny-huginn", n, "adaptive")
    assert adaptive.adapter.full_depth == n
    assert isinstance(adaptive.controller, AdaptiveController)
    preset = adaptive.controller.config
    assert preset.full_depth == n
    assert all(c.k == 0 or 1 <= c.d < n for b in preset.buckets for c in b.candidates)
    notes = fitting_notes(caplog)
    if n == TUNED_AT:
        assert notes == []
    else:
        assert len(notes) == 1, notes
        assert f"measured at depth {TUNED_AT}, the model runs {n}" in notes[0]
        assert "tiny-huginn" in notes[0]
    plain = engine("tiny-huginn", n, "off").generate(prompts, PARAMS)
    outs = adaptive.generate(prompts, PARAMS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    assert all(len(o.token_ids) > 1 for o in outs)
    assert adaptive.stats.num_spec_rounds > 0, adaptive.stats.plan_histogram
    assert all(int(key.split(",")[1]) < n for key in adaptive.stats.plan_histogram)  # every draft depth fits D
    assert adaptive.num_free_blocks == adaptive.kv.num_blocks


def dense_greedy(adapter, prompt: list[int], tokens: int, seed: int) -> tuple[list[int], float]:
    """Greedy continuation by cache-free full-depth forwards of the whole sequence (an independent reference: no KV
    cache, no loop planes, no speculation), and the smallest top-1 margin met on the way."""
    ids, margin = list(prompt), float("inf")
    for _ in range(tokens):
        logits = adapter.dense_logits(torch.tensor(ids), seeds=[seed])[0, -1]
        top = logits.topk(2).values
        margin = min(margin, float(top[0] - top[1]))
        ids.append(int(logits.argmax()))
    return ids[len(prompt) :], margin


@pytest.mark.parametrize("model,n", [("tiny-huginn", 4), ("tiny-huginn", 16), ("fixture", 12)])
def test_speculative_output_at_another_depth_is_the_dense_reference(model, n):
    if model == "fixture":  # random weights (no fixed point): a fixed plan drafting at d = 8 of 12
        adaptive = engine(fixture_dir("huginn"), n, "3,8")
        prompt = [5, 9, 13, 200, 7, 81, 33]
    else:
        adaptive = engine(model, n, "adaptive")
        prompt = adaptive.tokenizer.encode(prompt_group("code", 1)[0])
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, seed=7)
    out = adaptive.generate([prompt], params)[0]
    assert adaptive.stats.num_spec_rounds > 0
    reference, margin = dense_greedy(adaptive.adapter, prompt, 16, seed=7)
    assert margin > 1e-3  # no near tie: float differences between the two paths cannot flip a token
    assert out.token_ids == reference


@pytest.mark.parametrize("n", [3, 6])
def test_random_weight_huginn_fixture_is_lossless_at_other_depths(n, caplog):
    """Adaptive speculation (both policies) on the fixture's preset fitted to depth n is lossless; a random-weight
    model rarely pays for a draft, so a fixed plan at a rescaled depth runs the speculative path too."""
    caplog.set_level(logging.INFO, logger=PRESET_LOGGER)
    prompts = [[5, 9, 13, 200, 7], [1, 2, 3], [100, 42, 42, 17, 250, 3, 9]]
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    plain = [o.token_ids for o in engine(fixture_dir("huginn"), n, "off").generate(prompts, params)]
    for policy in ("goodput", "ema"):
        caplog.clear()
        adaptive = engine(fixture_dir("huginn"), n, "adaptive", policy=policy)
        assert adaptive.adapter.full_depth == n and adaptive.controller.config.full_depth == n
        assert len(fitting_notes(caplog)) == 1  # the fixture's own preset.json is for depth 8
        outs = adaptive.generate(prompts, params)
        assert [o.token_ids for o in outs] == plain, policy
        assert adaptive.num_free_blocks == adaptive.kv.num_blocks
    fixed = engine(fixture_dir("huginn"), n, f"2,{n - 1}")
    assert [o.token_ids for o in fixed.generate(prompts, params)] == plain
    assert fixed.stats.num_spec_rounds > 0


def test_at_depth_one_adaptive_decodes_plainly_and_refuses_what_would_steer_it(caplog):
    """D = 1 leaves nothing to draft with: the default adaptive speculation decodes plainly and says so; a preset,
    policy or tunables given for it would do nothing and are errors naming them."""
    caplog.set_level(logging.INFO, logger="looped_spec.engine.model_options")
    one = engine("tiny-huginn", 1, "adaptive")
    assert not isinstance(one.controller, AdaptiveController)
    assert any("D=1 loop: nothing to draft with" in r.getMessage() for r in caplog.records)
    prompts = prompt_group("code", 2)
    want = [o.token_ids for o in engine("tiny-huginn", 1, "off").generate(prompts, PARAMS)]
    assert [o.token_ids for o in one.generate(prompts, PARAMS)] == want
    for option in ({"preset": "/no/such/preset.json"}, {"policy": "ema"}, {"control": {"readout_budget": 0.01}}):
        name = next(iter(option))
        with pytest.raises(ValueError, match=f"{name}=.*the model runs D=1 loop, nothing to draft with"):
            engine("tiny-huginn", 1, "adaptive", **option)
