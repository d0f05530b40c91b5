"""The tiny trained models shipped in looped_spec/models: load, tokenize, and stay lossless with speculation."""

from __future__ import annotations

import pytest

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig, load_adapter
from looped_spec.models import shipped_models

SHIPPED = sorted(shipped_models())
PROMPTS = ["def fibonacci(n):", "import os\n\n\nclass Config:\n    def __init__(self", "# Return the sum of"]


def test_the_three_families_are_shipped():
    assert {"tiny-ouro", "tiny-huginn", "tiny-nanbeige"} <= set(SHIPPED)


@pytest.fixture(scope="module", params=SHIPPED)
def shipped(request):
    return request.param, load_adapter(request.param, dtype="float32", device="cpu")


def test_loads_by_short_name_with_tokenizer(shipped):
    name, adapter = shipped
    engine = LoopedSpecEngine(adapter, speculation="off")
    assert engine.tokenizer is not None
    text = "def add(a, b):\n    return a + b\n"
    assert engine.tokenizer.decode(engine.tokenizer.encode(text)) == text
    out = engine.generate(PROMPTS[0], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert len(out.token_ids) == 6 and isinstance(out.text, str)


def test_greedy_speculative_equals_plain(shipped):
    name, adapter = shipped
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    plain = [o.token_ids for o in LoopedSpecEngine(adapter, speculation="off").generate(PROMPTS, params)]
    depth = adapter.full_depth
    for spec in [SpeculativeConfig(k=3, d=1), SpeculativeConfig(k=2, d=depth - 1), "adaptive"]:
        engine = LoopedSpecEngine(adapter, speculation=spec)
        outs = engine.generate(PROMPTS, params)
        assert [o.token_ids for o in outs] == plain, (name, spec)
        assert engine.num_free_blocks == engine.kv.num_blocks
    # trained shallow readouts make drafts genuinely useful
    engine = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=2, d=depth - 1))
    engine.generate(PROMPTS, params)
    assert engine.stats.acceptance_rate > 0.3, engine.stats.acceptance_rate


def test_cli_generate_prints_text_and_stats(capsys):
    from looped_spec.cli import main

    assert (
        main(
            [
                "generate",
                "--model",
                "tiny-nanbeige",
                "--prompt",
                "def add(a, b):",
                "--max-tokens",
                "12",
                "--speculation",
                "2,1",
            ]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert out.startswith("def add(a, b):")
    for field in ("tokens generated", "decode rounds", "draft tokens accepted", "plans used"):
        assert field in out
    assert "tokens/s" not in out  # a bare rate is no speed claim: --compare-plain gives the ratio


def test_cli_reports_bad_model_cleanly(capsys):
    from looped_spec.cli import main

    assert main(["generate", "--model", "no-such-model", "--prompt", "x"]) == 2
    assert "no-such-model" in capsys.readouterr().err


def shipped_exit_params(adapter) -> list[SamplingParams]:
    """A τ sweep in the family's units (none for Nanbeige, which has no exit signal) and fixed depths."""
    depth = adapter.full_depth
    taus = {"ouro": [0.7, 0.9, 0.95], "huginn_raven": [1e-3, 1e-2, 0.1]}.get(adapter.model_type, [])
    fixed = sorted({1, max(1, depth // 2)})
    return [SamplingParams(exit_threshold=t) for t in taus] + [SamplingParams(exit_at_step=k) for k in fixed]


def test_skip_mode_early_exit_matches_the_independent_reference(shipped):
    """Issue 13 on the shipped models: plain and speculative skip-mode decoding against the token-by-token
    reference of test_early_exit.py (its own KV store, skipped planes filled by the documented rule)."""
    from test_early_exit import engine_generate, reference_generate

    name, adapter = shipped
    family = {"ouro": "ouro", "huginn_raven": "huginn"}.get(adapter.model_type, "nanbeige")
    plain = LoopedSpecEngine(adapter, speculation="off", early_exit="skip")
    speculative = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=3, d=1), early_exit="skip")
    prompt = plain.tokenizer.encode(PROMPTS[0])
    depths_seen = set()
    for params in shipped_exit_params(adapter):
        params = params.model_copy(update={"max_tokens": 8, "ignore_eos": True, "seed": 5})
        tokens, logits, depths = reference_generate(adapter, family, prompt, 8, params, "skip", seed=5)
        want = (tokens, {e: depths.count(e) for e in set(depths)})
        out, got_logits, got_depths = engine_generate(plain, prompt, params)  # plain: logits and depths too
        assert (out.token_ids, got_depths) == (tokens, depths), (name, params)
        for got, ref in zip(got_logits, logits):
            assert (got - ref).abs().max() <= 1e-4 * (1 + ref.abs().max()), (name, params)
        out = speculative.generate([prompt], params)[0]
        assert (out.token_ids, out.metrics.exit_depth_histogram) == want, (name, params)
        depths_seen.update(depths)
    assert min(depths_seen) < adapter.full_depth


def test_loop_passes_equal_the_step_engine(shipped):
    """Issue 35's identity on the trained models, whose exits spread as real text makes them: 32 requests with mixed
    early-exit parameters (full depth, the family's rule at several τ, fixed depths), eight of them arriving while the
    others run, decoded plainly, with a fixed plan and with adaptive plans; greedy, fp32, in both early-exit modes."""
    name, adapter = shipped
    step_engine = LoopedSpecEngine(adapter, speculation="off")
    texts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(32)]
    prompts = [step_engine.tokenizer.encode(t) for t in texts]
    kinds = [SamplingParams(), *shipped_exit_params(adapter)]
    # every prompt under every kind (prompts cycle every request, kinds every three)
    params = [kinds[i // 3 % len(kinds)].model_copy(update={"max_tokens": 6, "ignore_eos": True}) for i in range(32)]

    def run(engine) -> list[list[int]]:
        ids = [engine.add_request(p, q) for p, q in zip(prompts[:24], params[:24])]
        outs, steps = {}, 0
        while engine.has_unfinished_requests():
            steps += 1
            if steps == 3:  # the last eight arrive mid-run
                ids += [engine.add_request(p, q) for p, q in zip(prompts[24:], params[24:])]
            outs.update({o.request_id: o.token_ids for o in engine.step() if o.finished})
        assert engine.num_free_blocks == engine.kv.num_blocks
        return [outs[i] for i in ids]

    fixed = SpeculativeConfig(k=3, d=max(1, adapter.full_depth // 2))
    for early_exit, spec in (("skip", "off"), ("skip", fixed), ("skip", "adaptive"), ("select", fixed)):
        options = dict(speculation=spec, early_exit=early_exit, max_batch_size=32)
        step, loop = LoopedSpecEngine(adapter, **options), LoopedSpecEngine(adapter, batching="loop", **options)
        assert run(loop) == run(step), (name, early_exit, spec)
        assert min(loop.stats.exit_depth_histogram) < adapter.full_depth  # tokens exited early
        assert loop.stats.num_loop_passes > 0 and (spec != fixed or loop.stats.num_draft_tokens > 0)
