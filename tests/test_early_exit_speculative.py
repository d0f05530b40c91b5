"""Speculation with early exit (issue 13): the target is the early-exit model. Greedy speculative decoding
equals greedy plain decoding in the same mode (and the independent token-by-token reference of
test_early_exit.py); sampling keeps the early-exit model's distribution; positions that exit within the
draft skip verification and are left out of the controller's acceptance."""

from __future__ import annotations

import functools
import itertools
import os

import pytest
import torch
from chisquare import assert_distribution
from conftest import FAMILIES, fixture_dir, load, reference
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st
from test_early_exit import exit_params, mixed_params, reference_generate

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig, load_adapter
from looped_spec.control.controller import FixedController
from looped_spec.engine import step_decoding

MODES = ["skip", "select"]


def batch_params(family: str) -> list[SamplingParams]:
    """Eight requests: rules, fixed depths and one without early exit, with max_tokens cutting K (ragged)."""
    rules = [p.model_copy(update={"ignore_eos": True, "seed": 3}) for p in exit_params(family)] + mixed_params(family)
    return [p.model_copy(update={"max_tokens": 5 + (3 * i) % 8}) for i, p in enumerate(rules[:8])]


def batch_prompts(family: str, n: int) -> list[list[int]]:
    prompts = reference(family)["prompts"]
    return [prompts[i % len(prompts)] for i in range(n)]


def grid(family: str) -> list[tuple[int, int]]:
    return list(itertools.product([1, 2, 3, 5], range(1, load(family).full_depth)))


def run(engine: LoopedSpecEngine, prompts, params):
    outs = engine.generate(prompts, params)
    assert engine.num_free_blocks == engine.kv.num_blocks
    return [(o.token_ids, o.metrics.exit_depth_histogram) for o in outs]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_equals_plain_with_early_exit(family, mode):
    """Every (K, d) x B in {1, 3, 8}: the same tokens and the same exit depths as plain decoding."""
    adapter = load(family)
    params = batch_params(family)
    prompts = batch_prompts(family, len(params))
    plain = LoopedSpecEngine(adapter, speculation="off", early_exit=mode, max_batch_size=8)
    want = run(plain, prompts, params)
    decided = verified = 0
    for k, d in grid(family):
        engine = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=k, d=d), early_exit=mode, max_batch_size=8)
        for lo, hi in ((0, 1), (1, 4), (0, 8)):
            assert run(engine, prompts[lo:hi], params[lo:hi]) == want[lo:hi], (k, d, hi - lo)
        decided += engine.stats.num_exit_draft_decided
        verified += engine.stats.num_draft_tokens - engine.stats.num_exit_draft_decided
    assert decided > 0 and verified > 0  # both paths ran: drafts the target drew itself, and checked ones


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_speculative_with_per_token_stopping_equals_plain_with_early_exit(family, mode):
    """Per-token stopping under early exit (issue 36, item 4): a draft read out at d stops its row when unsure; a
    position that exited within the draft is the target's own sample and never does. From 'never stops' to 'always
    stops', B in {1, 3, 8}: the same tokens and exit depths as plain decoding."""
    adapter = load(family)
    params = batch_params(family)
    prompts = batch_prompts(family, len(params))
    plain = LoopedSpecEngine(adapter, speculation="off", early_exit=mode, max_batch_size=8)
    want = run(plain, prompts, params)
    drafted = {}
    for margin in (1e-6, 0.05, 0.3, 1.0):
        spec = SpeculativeConfig(k=3, d=1, stop_margin=margin)
        engine = LoopedSpecEngine(adapter, speculation=spec, early_exit=mode, max_batch_size=8)
        for lo, hi in ((0, 1), (1, 4), (0, 8)):
            assert run(engine, prompts[lo:hi], params[lo:hi]) == want[lo:hi], (margin, hi - lo)
        drafted[margin] = engine.stats.num_draft_tokens - engine.stats.num_exit_draft_decided
    assert drafted[1e-6] > drafted[1.0]  # the rule stopped drafts
    assert drafted[1.0] == 0  # no margin reaches 1: only the positions the target decided within the draft remain


@pytest.mark.parametrize("family", FAMILIES)
def test_skip_mode_speculation_matches_the_independent_reference(family):
    """Against the token-by-token reference (its own KV store, skipped planes filled by the documented rule)."""
    adapter = load(family)
    engine = LoopedSpecEngine(adapter, speculation="3,1", early_exit="skip")
    for params in exit_params(family):
        params = params.model_copy(update={"max_tokens": 10, "ignore_eos": True, "seed": 7})
        for prompt in reference(family)["prompts"]:
            out = engine.generate([prompt], params)[0]
            tokens, _, depths = reference_generate(adapter, family, prompt, 10, params, "skip", seed=7)
            assert out.token_ids == tokens, params
            assert out.metrics.exit_depth_histogram == {e: depths.count(e) for e in set(depths)}, params


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", FAMILIES)
def test_preemption_mid_request_with_speculation_and_early_exit(family, mode):
    """Requests recomputed after preemption redo their recorded exit depths, including those of tokens
    committed by speculative rounds."""
    adapter = load(family)
    params = [p.model_copy(update={"max_tokens": 9}) for p in batch_params(family)]
    prompts = batch_prompts(family, len(params))
    want = run(LoopedSpecEngine(adapter, speculation="off", early_exit=mode, max_batch_size=8), prompts, params)
    tight = LoopedSpecEngine(
        adapter, speculation="3,1", early_exit=mode, max_batch_size=4, block_size=4,
        num_kv_blocks=12, max_model_len=22,
    )  # fmt: skip
    assert run(tight, prompts, params) == want
    assert tight.scheduler.num_preemptions > 0 and tight.stats.num_spec_rounds > 0


def test_positions_that_exit_within_the_draft_are_not_verified():
    """exit_at_step=1 with d=2: every position exits in the draft, so no loop beyond d runs in decode rounds,
    every draft is accepted, and the controller learns nothing from them (nothing was verified)."""
    adapter = load("ouro")
    engine = LoopedSpecEngine(adapter, speculation="3,2", early_exit="skip")
    engine.controller = FixedController(3, 2)
    seen = []
    engine.controller.observe = seen.append
    loops_run: list[int] = []
    loop = adapter.loop

    def counting_loop(state, i, ctx):
        loops_run.append(i)
        return loop(state, i, ctx)

    prompt = reference("ouro")["prompts"][0]
    adapter.loop = counting_loop
    try:
        out = engine.generate([prompt], SamplingParams(max_tokens=13, ignore_eos=True, exit_at_step=1))[0]
    finally:
        adapter.loop = loop
    plain = LoopedSpecEngine(adapter, speculation="off").generate(
        [prompt], SamplingParams(max_tokens=13, ignore_eos=True, exit_at_step=1)
    )[0]
    assert out.token_ids == plain.token_ids
    depth = adapter.full_depth
    assert loops_run[:depth] == list(range(depth))  # the prompt: every loop once, in one chunk
    assert set(loops_run[depth:]) == {0}  # decode rounds: loop 1 only, never a verify loop
    assert engine.stats.num_exit_draft_decided == engine.stats.num_accepted_tokens > 0
    assert all(sum(f.num_proposed) == 0 and sum(f.num_accepted) == 0 for f in seen)


def test_controller_acceptance_counts_only_verified_drafts():
    adapter = load("ouro")
    engine = LoopedSpecEngine(adapter, speculation="2,1", early_exit="skip")
    engine.controller = FixedController(2, 1)
    seen = []
    engine.controller.observe = seen.append
    params = [SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=t) for t in (0.3, 0.6, 0.9)]
    engine.generate(batch_prompts("ouro", 3), params)
    stats = engine.stats
    decided = stats.num_exit_draft_decided
    assert decided > 0
    # the controller hears of the verified drafts only: every decided draft was accepted, and left out
    assert sum(sum(f.num_accepted) for f in seen) == stats.num_accepted_tokens - decided
    assert 0 < sum(sum(f.num_proposed) for f in seen) <= stats.num_draft_tokens - decided


@pytest.mark.parametrize("mode", MODES)
def test_huginn_kl_rule_requests_decode_plainly_inside_speculative_rounds(mode):
    """The KL rule reads out through the coda's attention, so its requests get K = 0; the others draft."""
    adapter = load_adapter(fixture_dir("huginn"), device="cpu", initial_state="zeros")
    assert adapter.exit_rule_reads_kv
    params = [
        SamplingParams(max_tokens=9, ignore_eos=True, exit_threshold=0.3),
        SamplingParams(max_tokens=9, ignore_eos=True, exit_at_step=3),
        SamplingParams(max_tokens=9, ignore_eos=True),
    ]
    prompts = batch_prompts("huginn", 3)
    want = run(LoopedSpecEngine(adapter, speculation="off", early_exit=mode), prompts, params)
    engine = LoopedSpecEngine(adapter, speculation="2,1", early_exit=mode)
    outs = engine.generate(prompts, params)
    assert [(o.token_ids, o.metrics.exit_depth_histogram) for o in outs] == want
    assert outs[0].metrics.num_draft_tokens == 0
    assert outs[1].metrics.num_draft_tokens > 0 and outs[2].metrics.num_draft_tokens > 0
    latent = load_adapter(fixture_dir("huginn"), device="cpu", initial_state="zeros", exit_criterion="latent")
    assert not latent.exit_rule_reads_kv


def reference_next_token_probs(adapter, family, seq, params, mode, keep):
    """(ids, probabilities) of the next token after `seq` under the early-exit model (its last position read
    out at its exit depth), from the independent reference."""
    _, logits, _ = reference_generate(adapter, family, seq, 1, params, mode, seed=0)
    return keep(logits[0])


def top_k_filter(logits: torch.Tensor, top_k: int) -> tuple[list[int], list[float]]:
    vals, idx = logits.topk(top_k)
    return idx.tolist(), vals.softmax(-1).tolist()


@pytest.mark.parametrize(
    "mode,exit_field,d,stop", [("skip", {"exit_threshold": 0.5}, 2, None), ("select", {"exit_threshold": 0.5}, 1, None),
                               ("skip", {"exit_at_step": 2}, 1, None), ("skip", {"exit_threshold": 0.5}, 1, 0.05)],
)  # fmt: skip
def test_speculative_sampling_keeps_the_early_exit_distribution(mode, exit_field, d, stop):
    """P(t1, t2) of the first two tokens: t1 from the prompt's last position, t2 from a speculative round
    (drafts the target drew itself mixed with rejection-sampled ones; with `stop`, rows that stopped at an unsure
    draft too), against the exact early-exit model."""
    adapter, family, top_k, n = load("ouro"), "ouro", 4, 3000
    prompt = [5, 9, 13, 200]
    params = SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, ignore_eos=True, **exit_field)
    keep = lambda logits: top_k_filter(logits, top_k)  # noqa: E731
    exact = {}
    ids1, p1 = reference_next_token_probs(adapter, family, prompt, params, mode, keep)
    for t1, q1 in zip(ids1, p1):
        ids2, p2 = reference_next_token_probs(adapter, family, prompt + [t1], params, mode, keep)
        for t2, q2 in zip(ids2, p2):
            exact[(t1, t2)] = q1 * q2
    engine = LoopedSpecEngine(
        adapter, speculation=SpeculativeConfig(k=2, d=d, stop_margin=stop), early_exit=mode, max_batch_size=256,
        max_num_batched_tokens=4096, seed=1234,
    )  # fmt: skip
    outs = engine.generate([prompt] * n, params)
    assert engine.stats.num_accepted_tokens > 0
    if stop is not None:  # some rows stopped at an unsure draft, others drafted on
        assert 0 < engine.stats.num_draft_tokens < 2 * n
    assert_distribution((tuple(o.token_ids[:2]) for o in outs), exact)


@pytest.mark.parametrize("d", [1, 2])
def test_speculative_target_logits_equal_plain_logits_in_skip_mode(monkeypatch, d):
    """Stronger than equal tokens: every committed token's target logits in speculative rounds equal those
    plain skip-mode decoding drew it from (a wrong KV plane shifts logits long before it flips an argmax)."""
    from test_early_exit import record_logits

    import looped_spec.speculative.round as round_module

    adapter = load("ouro")
    params = [SamplingParams(max_tokens=12, ignore_eos=True, exit_threshold=t) for t in (0.3, 0.5, 0.6, 0.7, 0.9)]
    prompts = batch_prompts("ouro", len(params))
    plain = LoopedSpecEngine(adapter, speculation="off", early_exit="skip", max_batch_size=8)
    plain_logits = record_logits(plain)
    plain_ids = [o.request_id for o in plain.generate(prompts, params)]
    engine = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=3, d=d), early_exit="skip", max_batch_size=8)
    spec_logits = record_logits(engine)  # prefill (first tokens) and plain rounds
    verify = round_module.verify_with_exit

    def recording_verify(runner, requests, k, dd, steps, mode):
        out = verify(runner, requests, k, dd, steps, mode)
        start = 0
        for request, kr in zip(requests, k):  # positions 0..K of each request, request after request
            pending.append((request.request_id, out.logits[start : start + kr + 1].clone()))
            start += kr + 1
        return out

    pending: list = []
    monkeypatch.setattr(round_module, "verify_with_exit", recording_verify)
    original_finish = step_decoding.finish_round

    def finish(engine, requests, k, plan, result, *timing):  # keep the committed positions' logits, in commit order
        by_id = dict(pending)
        for request, committed in zip(requests, result.committed):
            if request.request_id in by_id:
                spec_logits.setdefault(request.request_id, []).extend(by_id[request.request_id][: len(committed)])
        pending.clear()
        return original_finish(engine, requests, k, plan, result, *timing)

    monkeypatch.setattr(step_decoding, "finish_round", finish)
    outs = engine.generate(prompts, params)
    assert engine.stats.num_spec_rounds > 0
    for out, plain_id in zip(outs, plain_ids):
        got, want = spec_logits[out.request_id], plain_logits[plain_id]
        assert len(got) >= len(out.token_ids) and len(want) == len(out.token_ids)
        for a, b in zip(got, want):
            assert (a - b).abs().max() <= 1e-4 * (1 + b.abs().max())


# ----- property: random exit settings, plans and batches against plain early-exit decoding -----
#: per family: thresholds of its rule that exit at mixed depths on the fixtures (Huginn's default KL rule decodes its
#: requests plainly inside rounds, K = 0; its latent rule speculates); Nanbeige has no rule, exit_at_step only
PROPERTY_THRESHOLDS = {"ouro": [0.2, 0.5, 0.8, 0.95], "huginn": [1e-3, 3e-2, 0.3], "huginn-latent": [0.05, 0.2, 0.5],
                       "nanbeige": []}  # fmt: skip


@functools.cache
def property_model(family: str):
    if family == "huginn-latent":
        return load_adapter(fixture_dir("huginn"), device="cpu", initial_state="zeros", exit_criterion="latent")
    return load(family)


exit_request_st = st.fixed_dictionaries(
    {
        "prompt": st.tuples(st.integers(0, 1), st.lists(st.integers(1, 255), max_size=5)),
        "max_tokens": st.integers(4, 16),
        "exit": st.tuples(
            st.sampled_from([None, "exit_at_step", "exit_threshold", "exit_threshold"]), st.integers(0, 7)
        ),
        # always some: they show a readout's logits, not just its argmax
        "logprobs": st.sampled_from([0, 2]),
        # an eighth of the vocabulary stops it: stops land inside accepted drafts
        "stops": st.sampled_from([False, False, True]),
    }
)


PINNED_EXIT_REQUESTS = [
    {"prompt": (base, []), "max_tokens": 10, "exit": ("exit_threshold", n), "logprobs": 0, "stops": False}
    for base, n in ((0, 1), (1, 2), (1, 0))
]


def property_request(spec: dict, family: str) -> tuple[list[int], SamplingParams]:
    depth, thresholds = property_model(family).full_depth, PROPERTY_THRESHOLDS[family]
    base, extra = spec["prompt"]
    fields = {}
    kind, n = spec["exit"]
    if kind is not None:
        if kind == "exit_threshold" and thresholds:
            fields["exit_threshold"] = thresholds[n % len(thresholds)]
        else:  # depths 1..D: exits within the draft, at d, at d + 1 and never (D) all come up
            fields["exit_at_step"] = 1 + n % depth
    params = SamplingParams(max_tokens=spec["max_tokens"], ignore_eos=not spec["stops"], logprobs=spec["logprobs"],
                            stop_token_ids=list(range(3, 256, 8)) if spec["stops"] else [], **fields)  # fmt: skip
    return reference(family.split("-")[0])["prompts"][base] + extra, params


def exit_outcome(out, close=float) -> tuple:
    """What plain early-exit decoding fixes for a request: tokens, why it ended, exit depths, log-probabilities (of
    the logits each token was drawn from: the readout at its exit depth), each value wrapped in `close`."""
    logprobs = [(e.token, close(e.logprob), [(t, close(v)) for t, v in e.top]) for e in out.logprobs]
    return out.token_ids, out.finish_reason, dict(out.metrics.exit_depth_histogram), logprobs


def exit_stats(engine) -> tuple:
    s = engine.stats
    return dict(s.exit_depth_histogram), s.num_exit_loops_run, s.num_exit_loops_saved


@settings(max_examples=int(os.environ.get("LOOPED_SPEC_HYPOTHESIS_EXAMPLES", "15")), deadline=None,
          derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow])  # fmt: skip
@pytest.mark.parametrize("family", sorted(PROPERTY_THRESHOLDS))
@given(
    mode=st.sampled_from(MODES),
    batching=st.sampled_from(["step", "loop"]),
    k=st.integers(1, 5),
    d=st.integers(0, 6),
    stop_margin=st.sampled_from([None, None, 0.05]),
    specs=st.lists(exit_request_st, min_size=1, max_size=4),
)
# pinned: skip mode with positions exiting during verification, between d and D, before later positions loop on
@example(mode="skip", batching="step", k=3, d=0, stop_margin=None, specs=PINNED_EXIT_REQUESTS)
@example(mode="skip", batching="loop", k=3, d=0, stop_margin=None, specs=PINNED_EXIT_REQUESTS)
def test_random_exits_plans_and_batches_equal_plain_early_exit_decoding(
    family, mode, batching, k, d, stop_margin, specs
):
    """Greedy requests with random exit settings side by side (exit_at_step within, at and past the draft depth,
    the family's rule at several thresholds, none), under a random plan (K, d), per-token stopping or not, on steps
    or loop passes: each request's tokens, finish reason, exit depths and log-probabilities (read out at the exit
    depth) are those of plain early-exit decoding of it alone, and the engine's exit statistics are plain decoding's
    of the same batch."""
    adapter = property_model(family)
    plan = SpeculativeConfig(k=k, d=1 + d % (adapter.full_depth - 1), stop_margin=stop_margin)
    prompts, params = zip(*(property_request(spec, family) for spec in specs))
    plain = LoopedSpecEngine(adapter, speculation="off", early_exit=mode)
    close = functools.partial(pytest.approx, abs=1e-4)
    want = [exit_outcome(plain.generate([p], [q])[0], close) for p, q in zip(prompts, params)]
    batch = LoopedSpecEngine(adapter, speculation="off", early_exit=mode)
    batch.generate(list(prompts), list(params))
    engine = LoopedSpecEngine(adapter, speculation=plan, early_exit=mode, batching=batching)
    got = [exit_outcome(out) for out in engine.generate(list(prompts), list(params))]
    assert got == want
    assert exit_stats(engine) == exit_stats(batch)
    assert engine.stats.num_exit_draft_decided <= engine.stats.num_accepted_tokens
    assert engine.num_free_blocks == engine.kv.num_blocks
    event(f"drafts decided by the exit rule: {engine.stats.num_exit_draft_decided > 0}")
    event(f"drafts verified: {engine.stats.num_draft_tokens > engine.stats.num_exit_draft_decided}")


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_a_draft_position_after_one_that_ran_on_is_not_taken_where_the_readout_attends(batching):
    """Huginn's readout (its coda) attends: a position that exits inside the draft is the target's only if every
    position before it did too, else it attended to a coda KV the target rewrites at that position's deeper exit
    depth. Under the latent rule (the KL rule decodes such requests plainly) positions exit at various depths inside
    the draft of (3, 5); taking such a position as decided changes logprobs and tokens (no test failed when the
    rule's "every position before it" was dropped, in exit_round.py or in loop_batching/items.py)."""
    adapter = load_adapter(fixture_dir("huginn"), device="cpu", initial_state="zeros", exit_criterion="latent")
    prompts = [[5, 9, 13, 2], [7, 1, 8], [3, 3, 11, 4, 6], [20, 21, 22]]
    params = SamplingParams(max_tokens=10, ignore_eos=True, exit_threshold=0.2, logprobs=0)
    plain = LoopedSpecEngine(adapter, speculation="off", early_exit="skip").generate(prompts, params)
    engine = LoopedSpecEngine(adapter, speculation="3,5", early_exit="skip", batching=batching)
    spec = engine.generate(prompts, params)
    assert engine.stats.num_spec_rounds > 0 and engine.stats.num_exit_draft_decided > 0
    for want, got in zip(plain, spec):
        assert got.token_ids == want.token_ids
        assert [e.logprob for e in got.logprobs] == pytest.approx([e.logprob for e in want.logprobs], abs=1e-4)
