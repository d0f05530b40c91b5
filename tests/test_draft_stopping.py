"""Per-token stopping (SpeculativeConfig.stop_margin, issue 36): a request drafts while its draft's top-two margin at
depth d stays at or above the threshold. Lossless: greedy output equals plain decoding's; sampled output keeps the
target distribution (chi-square), because the rule reads only the draft's own distribution."""

from __future__ import annotations

import pytest
from chisquare import assert_distribution
from conftest import FAMILIES, load, make_engine
from test_speculative import batches, exact_pair_distribution, greedy, top_k_filter

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("margin", [1e-6, 0.05, 0.3, 1.0])
def test_greedy_with_stopping_equals_plain(family, margin):
    """Batch sizes 1, 3 and 8 with ragged max_tokens; every margin from 'never stops' to 'always stops'."""
    plain = make_engine(family, max_batch_size=8)
    engine = make_engine(family, speculation=SpeculativeConfig(k=3, d=1, stop_margin=margin), max_batch_size=8)
    for prompts, max_tokens in batches():
        params = [greedy(n) for n in max_tokens]
        want = [o.token_ids for o in plain.generate(prompts, params)]
        assert [o.token_ids for o in engine.generate(prompts, params)] == want, (len(prompts), margin)
    assert engine.num_free_blocks == engine.kv.num_blocks
    stats = engine.stats
    if margin == 1.0:  # no margin reaches 1: every draft is unsure, every round verifies its first position only
        assert stats.num_draft_tokens == 0 and stats.num_spec_rounds > 0
    else:
        assert stats.num_draft_tokens >= stats.num_accepted_tokens


def test_stopping_drafts_fewer_and_never_proposes_an_unsure_draft(monkeypatch):
    """Every proposed draft was read out with a margin at or above the threshold, some rounds stopped early, and
    the drafts that remain are accepted more often than a fixed K's."""
    from looped_spec.speculative import proposer

    drawn_margins: list[float] = []
    real_draw = proposer.draw_drafts

    def recording_draw(logits, requests, drafted=None, batch_rows=None):
        top2 = logits.float().softmax(-1).topk(2, dim=-1).values
        drawn_margins.extend((top2[:, 0] - top2[:, 1]).tolist())
        return real_draw(logits, requests, drafted, batch_rows)

    monkeypatch.setattr(proposer, "draw_drafts", recording_draw)
    # a trained model (the fixtures' random weights accept almost nothing): its depth-1 margin tells accepted from
    # rejected drafts (docs/benchmarking.md, "Draft confidence")
    margin = 0.3
    engine = LoopedSpecEngine("tiny-ouro", speculation=SpeculativeConfig(k=4, d=1, stop_margin=margin))
    full = LoopedSpecEngine("tiny-ouro", speculation=SpeculativeConfig(k=4, d=1))
    prompts = ["def fibonacci(n):", "import os\n", "class Stack:", "for i in range(10):"]
    params = SamplingParams(max_tokens=32, ignore_eos=True)
    engine.generate(prompts, params)
    assert len(drawn_margins) == engine.stats.num_draft_tokens > 0 and min(drawn_margins) >= margin
    drawn_margins.clear()
    full.generate(prompts, params)
    assert min(drawn_margins) < margin  # without the rule, unsure drafts are proposed
    assert engine.stats.num_draft_tokens < full.stats.num_draft_tokens
    rate = engine.stats.num_accepted_tokens / engine.stats.num_draft_tokens
    assert rate > full.stats.num_accepted_tokens / full.stats.num_draft_tokens


@pytest.mark.parametrize("family,margin", [("ouro", 0.01), ("nanbeige", 0.01)])
def test_sampling_with_stopping_keeps_the_target_distribution(family, margin):
    """Temperature 1, top-k 4: the first two tokens' joint distribution is the target's, with rounds in which
    requests stopped early and rounds in which they drafted on."""
    adapter = load(family)
    prompt, top_k, n = [5, 9, 13, 200], 4, 3000
    exact = exact_pair_distribution(adapter, prompt, lambda logits: top_k_filter(logits, top_k))
    engine = make_engine(family, speculation=SpeculativeConfig(k=2, d=1, stop_margin=margin), max_batch_size=256,
                         max_num_batched_tokens=4096, seed=1234)  # fmt: skip
    outs = engine.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True))
    stats = engine.stats
    assert 0 < stats.num_draft_tokens < 2 * n * 2  # some requests stopped, some drafted
    assert stats.num_accepted_tokens > 0
    assert_distribution((tuple(o.token_ids[:2]) for o in outs), exact)


def test_stop_margin_is_checked_and_refused_where_it_does_not_run():
    with pytest.raises(ValueError, match="less than or equal to 1"):
        SpeculativeConfig(k=2, d=1, stop_margin=1.5)
    with pytest.raises(ValueError, match="stop_margin: not together with measure_depths"):
        SpeculativeConfig(k=2, d=1, stop_margin=0.2, measure_depths=True)
    # plain decoding drafts nothing: a margin would stop nothing (the engine would drop it without a word)
    with pytest.raises(ValueError, match="stop_margin=0.2 with k=0: plain decoding drafts nothing to stop"):
        SpeculativeConfig(k=0, stop_margin=0.2)
    with pytest.raises(ValueError, match=r"^LoopedSpecEngine: speculation: stop_margin=0.2 with k=0"):
        LoopedSpecEngine(load("ouro"), speculation={"k": 0, "stop_margin": 0.2}, batching="loop")


@pytest.mark.parametrize("family", FAMILIES)
def test_stopping_on_loop_passes_equals_the_step_engine(family):
    """On loop passes a round stops drafting where the step engine's does (an unsure draft is not drawn, the round is
    verified as it stands; a first draft already unsure verifies its first position alone): greedy and sampled
    outputs, drafts proposed and accepted equal the step engine's, from 'never stops' to 'always stops'."""
    prompts = [[5, 9, 2, 7], [1, 2, 3], [44, 8, 19, 20, 21, 3, 7], [100], [6, 6, 6, 6, 6]]
    # under early exit a round stops at an unsure draft read out at d, as the step engine's exit rounds do
    exits = {"exit_threshold": 0.7} if family == "ouro" else {"exit_at_step": 2}
    for margin, extra in ((1e-6, {}), (0.05, {}), (0.3, {}), (1.0, {}), (0.3, exits)):
        spec = SpeculativeConfig(k=3, d=1, stop_margin=margin)
        # all greedy, all sampled, and mixed (a greedy row then drafts beside sampled rows at some steps and alone
        # at others, once they stopped)
        for temperatures in ((0.0,), (0.8,), (0.0, 0.8)):
            params = [SamplingParams(max_tokens=5 + 2 * i, temperature=temperatures[i % len(temperatures)], seed=i,
                                     ignore_eos=True, **extra) for i in range(len(prompts))]  # fmt: skip
            step = make_engine(family, speculation=spec)
            loop = make_engine(family, speculation=spec, batching="loop")
            label = (margin, extra, temperatures)
            assert [o.token_ids for o in loop.generate(prompts, params)] == [
                o.token_ids for o in step.generate(prompts, params)
            ], label
            assert loop.stats.num_draft_tokens == step.stats.num_draft_tokens, label
            assert loop.stats.num_accepted_tokens == step.stats.num_accepted_tokens, label
            assert loop.num_free_blocks == loop.kv.num_blocks and loop.loop_batcher.is_empty
