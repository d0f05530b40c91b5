"""Self-speculative decoding: lossless greedy, forced acceptance paths, sampling distribution, KV."""

from __future__ import annotations

import itertools

import pytest
import torch
from chisquare import assert_distribution, three_token_distribution
from conftest import FAMILIES, load, make_engine, reference
from oracle import OracleDraft

from looped_spec import SamplingParams, SpeculativeConfig

PROMPTS = [
    [5, 9, 13],
    [200, 1, 77, 4, 4, 19, 88, 23, 7, 150, 3],
    [42],
    [17, 18, 19, 20, 21, 22],
    [99, 98, 97, 96, 95, 94, 93, 92],
    [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9],
    [250, 251],
    [60, 61, 62, 63],
]
MAX_TOKENS = [12, 7, 15, 1, 10, 5, 13, 9]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


def batches():
    """Batch sizes 1, 3 and 8 with mixed prompt lengths and max_tokens."""
    return [(PROMPTS[:1], MAX_TOKENS[:1]), (PROMPTS[1:4], MAX_TOKENS[1:4]), (PROMPTS, MAX_TOKENS)]


@pytest.fixture(scope="module")
def plain_outputs():
    cache = {}
    for family in FAMILIES:
        engine = make_engine(family)
        cache[family] = [o.token_ids for o in engine.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])]
    return cache


def grid(family: str):
    depth = load(family).full_depth
    return [(0, 0)] + [(k, d) for k, d in itertools.product([1, 2, 3, 5], range(1, depth))]  # (0, 0): plain


@pytest.mark.parametrize("family,k,d", [(f, k, d) for f in FAMILIES for k, d in grid(f)])
def test_greedy_speculative_equals_plain(family, k, d, plain_outputs):
    engine = make_engine(family, speculation=SpeculativeConfig(k=k, d=d), max_batch_size=8)
    for prompts, max_tokens in batches():
        outs = engine.generate(prompts, [greedy(n) for n in max_tokens])
        start = PROMPTS.index(prompts[0])
        assert [o.token_ids for o in outs] == plain_outputs[family][start : start + len(prompts)]
        assert engine.num_free_blocks == engine.kv.num_blocks
    if k == 0:
        assert engine.stats.num_spec_rounds == 0


@pytest.mark.parametrize("family", FAMILIES)
def test_fixture_continuations_with_speculation(family):
    ref = reference(family)
    depth = ref["full_depth"]
    engine = make_engine(family, speculation=SpeculativeConfig(k=3, d=depth // 2, measure_depths=True))
    outs = engine.generate(ref["prompts"], [greedy(len(g["tokens"])) for g in ref["greedy"]])
    assert [o.token_ids for o in outs] == [g["tokens"] for g in ref["greedy"]]


def breaking_oracle(prompts, continuations, miss: int, vocab: int) -> OracleDraft:
    """Drafts the true greedy continuation but breaks it at draft index `miss`."""
    return OracleDraft(prompts, continuations, vocab, lambda j: j == miss)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("miss", [0, 1, 2, 3])
def test_every_rejection_position_and_bonus(family, miss, plain_outputs):
    k = 3
    prompts, max_tokens = PROMPTS[:3], [30, 30, 30]
    expected = [o.token_ids for o in make_engine(family).generate(prompts, [greedy(n) for n in max_tokens])]
    oracle = breaking_oracle(prompts, expected, miss, load(family).vocab_size)
    engine = oracle.attach(make_engine(family, speculation=SpeculativeConfig(k=k, d=1)))
    ids = [engine.add_request(p, greedy(n)) for p, n in zip(prompts, max_tokens)]
    requests = [engine._requests[i] for i in ids]
    accepted_per_round = min(miss, k)  # miss == k: every draft matches and the bonus token is taken
    while engine.has_unfinished_requests():
        before = {r.request_id: (r.num_tokens, r.metrics.num_accepted_tokens) for r in requests}
        was_decoding = {r.request_id: r.prefilled for r in requests}
        engine.step()
        for r in requests:
            if not was_decoding[r.request_id] or r.request_id not in before:
                continue
            n_before, acc_before = before[r.request_id]
            gained = r.num_tokens - n_before
            if r.finished:
                assert gained <= accepted_per_round + 1
                continue
            k_actual = min(k, r.max_tokens - (n_before - r.num_prompt_tokens) - 1)
            assert r.metrics.num_accepted_tokens - acc_before == min(accepted_per_round, k_actual)
            assert gained == min(accepted_per_round, k_actual) + 1
            # KV covers every committed token but the last; blocks beyond it were released
            assert r.num_computed == r.num_tokens - 1
            assert len(r.block_table) == engine.kv.blocks_for(r.num_computed + 1)
    outs = [r.output_token_ids for r in requests]
    assert outs == expected
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_stop_token_inside_accepted_drafts():
    prompts = [PROMPTS[1]]
    expected = make_engine("ouro").generate(prompts, greedy(20))[0].token_ids
    stop = expected[5]
    first = expected.index(stop)
    oracle = breaking_oracle(prompts, [expected], miss=99, vocab=256)
    engine = oracle.attach(make_engine("ouro", speculation=SpeculativeConfig(k=5, d=2)))
    out = engine.generate(prompts, SamplingParams(max_tokens=20, stop_token_ids=[stop], ignore_eos=True))[0]
    assert out.token_ids == expected[: first + 1] and out.finish_reason == "stop"
    assert out.metrics.num_accepted_tokens > 0
    assert engine.num_free_blocks == engine.kv.num_blocks


@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_during_speculative_decoding(family):
    prompts = [list(range(1 + i, 12 + i)) for i in range(8)]
    expected = [o.token_ids for o in make_engine(family).generate(prompts, greedy(24))]
    engine = make_engine(
        family,
        speculation=SpeculativeConfig(k=3, d=1),
        block_size=4,
        num_kv_blocks=24,
        max_num_batched_tokens=16,
        max_model_len=64,
    )
    outs = engine.generate(prompts, greedy(24))
    assert [o.token_ids for o in outs] == expected
    assert engine.scheduler.num_preemptions > 0 and engine.stats.num_spec_rounds > 0
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_request_metrics_and_depth_measurements():
    depth = load("ouro").full_depth
    oracle = breaking_oracle(
        [PROMPTS[0]], [make_engine("ouro").generate([PROMPTS[0]], greedy(16))[0].token_ids], 2, 256
    )
    engine = oracle.attach(make_engine("ouro", speculation=SpeculativeConfig(k=3, d=2, measure_depths=True)))
    seen = []
    engine.controller.observe = seen.append
    out = engine.generate([PROMPTS[0]], greedy(16))[0]
    # the oracle breaks every draft at index 2: each round accepts 2 drafts and commits 3 tokens, so the 15 tokens
    # after the prefill's take 5 rounds, the last drafting only the 2 tokens left before its bonus
    assert [(f.num_proposed, f.num_accepted) for f in seen] == [([3], [2])] * 4 + [([2], [2])]
    m = out.metrics
    assert (m.rounds, m.num_draft_tokens, m.num_accepted_tokens) == (5, 14, 10)
    assert m.acceptance_rate == pytest.approx(10 / 14) and m.mean_accepted_length == pytest.approx(3.0)
    # every round measures its 3 committed positions at every depth; full depth is the greedy target itself
    assert all(f.depth_trials == [3] * depth and f.depth_matches[-1] == 3 for f in seen)
    assert all(0 < f.draft_seconds < f.seconds for f in seen)


def exact_pair_distribution(adapter, prompt, keep) -> dict[tuple[int, int], float]:
    """P(t1, t2) of the next two tokens from dense full-depth logits; `keep(logits)` -> (ids, probabilities)."""
    probs = {}
    idx1, p1 = keep(adapter.dense_logits(torch.tensor(prompt))[0, -1])
    for t1, q1 in zip(idx1, p1):
        idx2, p2 = keep(adapter.dense_logits(torch.tensor(prompt + [t1]))[0, -1])
        for t2, q2 in zip(idx2, p2):
            probs[(t1, t2)] = q1 * q2
    return probs


def top_k_filter(logits: torch.Tensor, top_k: int) -> tuple[list[int], list[float]]:
    """Temperature 1 with top-k."""
    vals, idx = logits.topk(top_k)
    return idx.tolist(), vals.softmax(-1).tolist()


def top_p_filter(logits: torch.Tensor, top_p: float, temperature: float) -> tuple[list[int], list[float]]:
    """Temperature, then the smallest set of most likely tokens whose probability reaches top_p."""
    probs = (logits / temperature).softmax(-1)
    sorted_p, order = probs.sort(descending=True)
    keep = (sorted_p.cumsum(-1) - sorted_p) < top_p
    kept = sorted_p[keep]
    return order[keep].tolist(), (kept / kept.sum()).tolist()


@pytest.mark.parametrize("family,d", [("ouro", 1), ("nanbeige", 1)])
def test_speculative_sampling_keeps_target_distribution(family, d):
    adapter = load(family)
    prompt, top_k, n = [5, 9, 13, 200], 4, 3000
    exact = exact_pair_distribution(adapter, prompt, lambda logits: top_k_filter(logits, top_k))
    engine = make_engine(
        family, speculation=SpeculativeConfig(k=2, d=d), max_batch_size=256, max_num_batched_tokens=4096, seed=1234
    )
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True)
    outs = engine.generate([prompt] * n, params)
    assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens
    assert_distribution((tuple(o.token_ids[:2]) for o in outs), exact)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("policy", ["ema", "goodput"])
def test_adaptive_greedy_equals_plain(family, policy, plain_outputs, tmp_path):
    trace = tmp_path / "trace.jsonl"
    engine = make_engine(family, speculation="adaptive", policy=policy, trace_path=str(trace), max_batch_size=8)
    for prompts, max_tokens in batches():
        outs = engine.generate(prompts, [greedy(n) for n in max_tokens])
        start = PROMPTS.index(prompts[0])
        assert [o.token_ids for o in outs] == plain_outputs[family][start : start + len(prompts)]
    assert engine.num_free_blocks == engine.kv.num_blocks
    engine.close()  # flushes the trace
    assert trace.read_text().count("\n") >= engine.stats.num_rounds


def test_engine_defaults_to_adaptive():
    from looped_spec import LoopedSpecEngine
    from looped_spec.control import AdaptiveController

    engine = LoopedSpecEngine(load("ouro"))
    assert isinstance(engine.controller, AdaptiveController)


def test_plain_rounds_report_depth_agreement_when_asked():
    """While speculation is off, a plan with measure_depths still teaches the controller about depths."""
    from looped_spec.control.controller import FixedController

    engine = make_engine("ouro")
    engine.controller = FixedController(0, 0, measure_depths=True)
    seen = []
    engine.controller.observe = seen.append
    plain = make_engine("ouro").generate(PROMPTS[:3], [greedy(6)] * 3)
    outs = engine.generate(PROMPTS[:3], [greedy(6)] * 3)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain]
    depth = load("ouro").full_depth
    # 5 plain rounds of the 3 requests after prefill, each measuring its 3 tokens at every depth
    assert [(f.batch_size, f.depth_trials, f.depth_matches[-1]) for f in seen] == [(3, [3] * depth, 3)] * 5
    assert all(0 <= m <= 3 for f in seen for m in f.depth_matches)


@pytest.mark.parametrize("family", FAMILIES)
def test_seeded_speculative_sampling_is_batch_invariant(family):
    """With a fixed plan, a seeded request draws the same tokens alone or inside any batch."""
    params = [
        SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, top_k=12, seed=40 + i, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    spec = SpeculativeConfig(k=3, d=1)
    alone = [make_engine(family, speculation=spec).generate(p, sp)[0].token_ids for p, sp in zip(PROMPTS, params)]
    batched = make_engine(family, speculation=spec, max_batch_size=5).generate(PROMPTS, params)
    assert [o.token_ids for o in batched] == alone


def test_speculative_sampling_with_top_p_keeps_target_distribution():
    """First token after the prompt comes from prefill; the second from speculative rounds (top-p, T=0.7)."""
    adapter = load("nanbeige")
    prompt, n, top_p, temp = [7, 99, 3, 250, 18], 3000, 0.6, 0.7
    exact = exact_pair_distribution(adapter, prompt, lambda logits: top_p_filter(logits, top_p, temp))
    engine = make_engine(
        "nanbeige", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256, max_num_batched_tokens=4096, seed=99
    )
    outs = engine.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=temp, top_p=top_p, ignore_eos=True))
    assert engine.stats.num_accepted_tokens > 0
    assert_distribution((tuple(o.token_ids[:2]) for o in outs), exact)


def min_p_filter(logits: torch.Tensor, min_p: float, temperature: float) -> tuple[list[int], list[float]]:
    """Temperature, then the tokens at least min_p times as likely as the most likely one."""
    probs = (logits.double() / temperature).softmax(-1)
    keep = probs >= min_p * probs.max()
    kept = probs[keep]
    return keep.nonzero().flatten().tolist(), (kept / kept.sum()).tolist()


def test_speculative_sampling_with_min_p_keeps_target_distribution():
    """min_p filters the draft's and the target's distributions alike: rejection sampling keeps the target's."""
    adapter = load("ouro")
    prompt, n, min_p, temp = [11, 42, 7, 130], 3000, 0.15, 1.2
    exact = exact_pair_distribution(adapter, prompt, lambda logits: min_p_filter(logits, min_p, temp))
    engine = make_engine(
        "ouro", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256, max_num_batched_tokens=4096, seed=7
    )
    outs = engine.generate([prompt] * n, SamplingParams(max_tokens=3, temperature=temp, min_p=min_p, ignore_eos=True))
    assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens
    assert_distribution((tuple(o.token_ids[:2]) for o in outs), exact)


ADJUSTMENTS = {  # each changes greedy decoding: a bias banning plain's next token, penalties of repeated tokens,
    "logit bias": lambda first: dict(logit_bias={first: -100.0, 17: 3.0, 200: 2.5}),
    "penalties": lambda first: dict(repetition_penalty=1.6, presence_penalty=1.0, frequency_penalty=0.6),
    "min_tokens": lambda first: dict(min_tokens=5, stop_token_ids=[first]),  # plain's first token, masked early
}


@pytest.mark.parametrize("adjustment", list(ADJUSTMENTS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculation_with_adjusted_logits_is_plain_decoding_with_them(family, adjustment):
    """A logit bias or penalties change the output; the draft, the verifier and plain decoding all apply them (the
    penalties counting the drafts before each position), so greedy speculation still equals plain decoding."""
    depth = load(family).full_depth
    plain = make_engine(family, speculation="off")
    unadjusted = [o.token_ids for o in plain.generate(PROMPTS, SamplingParams(max_tokens=12, temperature=0.0))]
    params = [SamplingParams(max_tokens=12, temperature=0.0, **ADJUSTMENTS[adjustment](out[0])) for out in unadjusted]
    expected = [o.token_ids for o in plain.generate(PROMPTS, params)]
    assert sum(out != was for out, was in zip(expected, unadjusted)) >= len(PROMPTS) // 2
    stopping = SpeculativeConfig(k=4, d=1, stop_margin=0.01)
    modes = [dict(speculation="2,1"), dict(speculation=f"3,{depth - 1}"), dict(speculation="adaptive"),
             dict(speculation="2,1", batching="loop"), dict(speculation=stopping)]  # fmt: skip
    for mode in modes:
        engine = make_engine(family, max_batch_size=len(PROMPTS), **mode)
        got = [o.token_ids for o in engine.generate(PROMPTS, params)]
        assert got == expected, mode
        assert engine.num_free_blocks == engine.kv.num_blocks
    # under early exit, every token exiting at depth 2 (verified after a d = 1 draft) or 1 (decided within the draft)
    for step in (2, 1):
        exits = [p.model_copy(update={"exit_at_step": step}) for p in params]
        expected = [o.token_ids for o in plain.generate(PROMPTS, exits)]
        for mode in (dict(speculation="2,1"), dict(speculation="2,1", batching="loop"),
                     dict(speculation=SpeculativeConfig(k=3, d=1, stop_margin=0.01))):  # fmt: skip
            engine = make_engine(family, max_batch_size=len(PROMPTS), **mode)
            assert [o.token_ids for o in engine.generate(PROMPTS, exits)] == expected, (mode, step)


def test_plain_decoding_with_penalties_follows_an_independent_reference():
    """Greedy decoding with penalties against a loop over dense forwards with HF's repetition-penalty processor and
    OpenAI's presence/frequency formula (tests/test_sampler.py `reference_penalties`)."""
    from test_sampler import reference_penalties

    adapter = load("nanbeige")
    prompt, settings = [7, 99, 3, 250, 18, 3], dict(repetition_penalty=1.4, presence_penalty=0.5, frequency_penalty=0.3)
    out = make_engine("nanbeige").generate(prompt, SamplingParams(max_tokens=10, temperature=0.0, **settings))[0]
    tokens: list[int] = []
    for _ in range(10):
        logits = adapter.dense_logits(torch.tensor(prompt + tokens))[0, -1]
        adjusted = reference_penalties(logits, prompt, tokens, 1.4, 0.5, 0.3)
        tokens.append(int(adjusted.argmax()))
    assert out.token_ids == tokens


def test_speculative_sampling_with_penalties_keeps_target_distribution():
    """Each token's distribution depends on the tokens before it (the output so far): the draft and the verifier
    apply the same penalties at each position, drafts before it included, so rejection sampling keeps the penalised
    target's joint distribution of the first three tokens (the second and third from one K = 2 round)."""
    from test_sampler import reference_penalties

    adapter = load("ouro")
    prompt, n, top_k = [5, 9, 13, 200], 4000, 4
    rep, pres, freq = 1.5, 1.0, 0.5

    def next_tokens(output):
        logits = adapter.dense_logits(torch.tensor(prompt + output))[0, -1]
        return zip(*top_k_filter(reference_penalties(logits, prompt, output, rep, pres, freq), top_k))

    probs = three_token_distribution(next_tokens)
    engine = make_engine(
        "ouro", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256, max_num_batched_tokens=4096, seed=5
    )
    # max_tokens 4: the round after the first token drafts K = 2 (a round keeps one token of the budget for its last)
    params = SamplingParams(max_tokens=4, temperature=1.0, top_k=top_k, repetition_penalty=rep, presence_penalty=pres,
                            frequency_penalty=freq, ignore_eos=True)  # fmt: skip
    outs = engine.generate([prompt] * n, params)
    assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens
    assert engine.stats.num_draft_tokens >= 1.5 * n  # K = 2 rounds
    assert_distribution((tuple(o.token_ids[:3]) for o in outs), probs)


def test_speculative_sampling_with_a_logit_bias_keeps_target_distribution():
    adapter = load("ouro")
    prompt, n, bias = [11, 42, 7, 130], 3000, {5: 2.0, 9: 1.5, 60: -100.0}

    def keep(logits):
        biased = logits.double().clone()
        for token, value in bias.items():
            biased[token] += value
        return top_k_filter(biased, 6)

    exact = exact_pair_distribution(adapter, prompt, keep)
    engine = make_engine(
        "ouro", speculation=SpeculativeConfig(k=2, d=1), max_batch_size=256, max_num_batched_tokens=4096, seed=3
    )
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=6, logit_bias=bias, ignore_eos=True)
    outs = engine.generate([prompt] * n, params)
    assert engine.stats.num_accepted_tokens > 0 and engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens
    assert_distribution((tuple(o.token_ids[:2]) for o in outs), exact)
