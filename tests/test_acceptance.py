"""Acceptance (control/acceptance.py, tuning/acceptance_pass.py): the Markov model of match bits against a simulated
chain, the replay and statistics of recorded bits by hand, the online estimator on streams with a known truth, and
the engine's own readouts against its speculative rounds.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from looped_spec.control.acceptance import AcceptanceEstimator, accept_rate, markov_tokens, markov_tokens_upto
from looped_spec.tuning.acceptance_pass import bit_statistics, simulate_tokens


def markov_chain(alpha: float, rho: float, n: int, rng: random.Random) -> list[int]:
    """n match bits of the two-state chain: P(1 | 0) = α(1 − ρ), P(1 | 1) = ρ + α(1 − ρ) (stationary share α)."""
    p01 = alpha * (1.0 - rho)
    p11 = rho + p01
    bits, prev = [], rng.random() < alpha
    for _ in range(n):
        bits.append(int(prev))
        prev = rng.random() < (p11 if prev else p01)
    return bits


# --------------------------------------------------------------------------- markov_tokens


@pytest.mark.parametrize(
    "alpha,rho,k",
    [(0.7, 0.0, 3), (0.8, 0.5, 4), (0.5, 0.3, 2), (0.9, 0.8, 6), (0.3, 0.9, 5), (0.95, 0.2, 8), (0.6, 0.6, 1)],
)
def test_markov_tokens_is_what_rounds_replayed_on_a_simulated_chain_commit(alpha, rho, k):
    rng = random.Random(f"{alpha}-{rho}-{k}")
    bits = [markov_chain(alpha, rho, 60_000, rng) for _ in range(2)]
    tokens, rounds = simulate_tokens(bits, k)
    assert float(markov_tokens(alpha, rho, k)) == pytest.approx(tokens / rounds, rel=0.02)
    # and what the EMA policy measures, accepted drafts per drafted token
    assert float(accept_rate(alpha, rho, k)) == pytest.approx((tokens / rounds - 1.0) / k, rel=0.04)


def test_markov_tokens_without_persistence_is_geometric():
    for alpha in (0.0, 0.2, 0.5, 0.77, 0.99):
        for k in (1, 2, 3, 7, 16):
            assert float(markov_tokens(alpha, 0.0, k)) == pytest.approx((1.0 - alpha ** (k + 1)) / (1.0 - alpha))
    assert float(markov_tokens(1.0, 0.0, 5)) == pytest.approx(6.0)  # every draft and the bonus
    assert float(markov_tokens(1.0, 0.7, 5)) == pytest.approx(6.0)


@pytest.mark.parametrize("alpha", [0.02, 0.12, 0.5, 0.9])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_markov_tokens_is_continuous_up_to_full_persistence(alpha, k):
    """A persistence estimate of 1 (clipped) must not price every draft as accepted: as ρ → 1 the chain's escapes from
    both states vanish together and π₁ → α / ((K+1)(1 − α) + α). Until 2026-12-06 ρ = 1 gave 1 + K for any α > 0."""
    limit = 1.0 + k * alpha / ((k + 1) * (1.0 - alpha) + alpha)
    assert float(markov_tokens(alpha, 1.0, k)) == pytest.approx(limit, rel=1e-12)
    assert float(markov_tokens(alpha, 1.0 - 1e-9, k)) == pytest.approx(limit, rel=1e-6)
    assert float(markov_tokens(alpha, 1.0, k)) < 1.0 + k


@pytest.mark.parametrize("alpha", [0.0, 0.05, 0.4, 0.77, 0.97, 1.0])
@pytest.mark.parametrize("rho", [0.0, 0.3, 0.8, 0.999])
def test_markov_tokens_upto_is_the_chain_s_closed_form_for_every_k(alpha, rho):
    """The one-pass K = 0..k_max form against the chain written out per K: π₁ = p01·p11^K / (1 − p11^(K+1) +
    p01·p11^K), tokens = 1 + (1 − p11^K) / (1 − p11) · ((1 − π₁)·p01 + π₁·p11)."""
    p01 = alpha * (1.0 - rho)
    p11 = rho + p01
    upto = markov_tokens_upto(alpha, rho, 12)
    assert len(upto) == 13 and upto[0] == 1.0
    for k in range(1, 13):
        denominator = 1.0 - p11 ** (k + 1) + p01 * p11**k
        pi1 = p01 * p11**k / denominator if denominator > 0.0 else 1.0
        run = (1.0 - p11**k) / (1.0 - p11) if p11 < 1.0 else float(k)
        assert upto[k] == pytest.approx(1.0 + run * ((1.0 - pi1) * p01 + pi1 * p11), rel=1e-9, abs=1e-12), k


def test_markov_tokens_of_no_draft_is_one():
    for alpha, rho in [(0.0, 0.0), (0.9, 0.5), (1.0, 1.0)]:
        assert float(markov_tokens(alpha, rho, 0)) == 1.0
        assert float(accept_rate(alpha, rho, 0)) == 0.0


# --------------------------------------------------------------------------- replay and statistics by hand


def test_simulate_tokens_by_hand():
    # 7 generated tokens (the first from prefill): K = 2 accepts 1,1 then 1,1; two rounds of three tokens
    assert simulate_tokens([[1, 1, 0, 1, 1, 1]], 2) == (6, 2)
    # a miss first: the round commits the bonus only; then two drafts, cut to the two tokens left
    assert simulate_tokens([[0, 1, 1, 1]], 3) == (4, 2)
    # near the end the draft is cut to what is left: 4 generated tokens, one round of 2 drafts + bonus
    assert simulate_tokens([[1, 1, 1]], 5) == (3, 1)
    # K = 0: one token per round
    assert simulate_tokens([[1, 0, 1]], 0) == (3, 3)
    # a rejection in the middle: 1 | 0 -> 2 tokens, then 1,1,0 -> accepts 2, commits 3; then one left
    assert simulate_tokens([[1, 0, 1, 1, 0, 1]], 3) == (6, 3)
    # sequences add up, and an empty one (a single generated token) needs no round
    assert simulate_tokens([[1, 1, 0, 1, 1, 1], [0, 1, 1, 1], []], 2) == (6 + 4, 2 + 2)


def test_bit_statistics_by_hand():
    # ones 5 of 8; transitions 11 11 10 00 00 01 11: P(1|1) = 3/4, P(1|0) = 1/3
    alpha, rho, n = bit_statistics([[1, 1, 1, 0, 0, 0, 1, 1]])
    assert (alpha, n) == (5 / 8, 8)
    assert rho == pytest.approx(3 / 4 - 1 / 3)
    # transitions are counted inside each sequence only (none across the boundary)
    alpha, rho, n = bit_statistics([[1, 1], [0, 0], [1, 0]])
    assert (alpha, n) == (3 / 6, 6)
    assert rho == pytest.approx(1 / 2 - 0 / 1)
    # alternating bits: negative persistence is clipped to 0
    assert bit_statistics([[1, 0, 1, 0, 1, 0]])[1] == 0.0
    # no transition from a miss (or from a match): ρ unknown, 0
    assert bit_statistics([[1, 1, 1]]) == (1.0, 0.0, 3)
    assert bit_statistics([[0, 0]]) == (0.0, 0.0, 2)
    assert bit_statistics([]) == (0.0, 0.0, 0)


def test_bit_statistics_recover_a_simulated_chain():
    rng = random.Random(11)
    for alpha, rho in [(0.7, 0.0), (0.4, 0.6), (0.85, 0.3)]:
        a, r, n = bit_statistics([markov_chain(alpha, rho, 40_000, rng)])
        assert n == 40_000
        assert a == pytest.approx(alpha, abs=0.02) and r == pytest.approx(rho, abs=0.03)


# --------------------------------------------------------------------------- the online estimator


def readouts(rng: np.random.Generator, truth, positions: int) -> tuple[list[int], list[int]]:
    """One measured round: how many of `positions` committed positions each depth's readout predicted."""
    return [int(rng.binomial(positions, p)) for p in truth], [positions] * len(truth)


def test_estimator_starts_at_the_prior_and_full_depth_is_one():
    est = AcceptanceEstimator(3, [0.4, 0.6, 0.9], [0.1, 0.2, 0.0], prior_weight=16.0, memory=128.0)
    assert list(est.alpha) == pytest.approx([0.4, 0.6, 1.0])  # full depth agrees with itself whatever the prior
    assert list(est.rho)[:2] == pytest.approx([0.1, 0.2])  # the draft depths' persistence is the prior's
    assert est.positions == 0
    none = AcceptanceEstimator(3, None, None, prior_weight=16.0, memory=128.0)
    assert list(none.alpha) == [0.0, 0.0, 1.0]
    with pytest.raises(ValueError, match="2 depths"):
        AcceptanceEstimator(3, [0.5, 1.0], None, prior_weight=16.0, memory=128.0)


def test_estimator_converges_to_the_true_agreement():
    truth = [0.35, 0.8, 0.55]  # depth 4 is full depth
    est = AcceptanceEstimator(4, [0.9, 0.2, 0.9, 1.0], None, prior_weight=16.0, memory=128.0)
    rng = np.random.default_rng(5)
    for _ in range(600):  # 2400 positions
        matches, trials = readouts(rng, [*truth, 0.97], 4)  # a sampled request's token can miss at full depth
        est.observe_readouts(matches, trials)
    assert est.positions == 2400
    assert list(est.alpha[:3]) == pytest.approx(truth, abs=0.1)
    assert est.alpha[3] == 1.0


def test_the_prior_counts_as_prior_weight_positions():
    """With nothing forgotten (huge memory), the estimate is (α₀·w + matches) / (w + trials): a light prior follows
    the readouts at once, a heavy one slowly."""
    rng = np.random.default_rng(2)
    stream = [readouts(rng, [0.9, 1.0], 4) for _ in range(16)]  # 64 positions at α = 0.9
    matches = sum(m[0] for m, _ in stream)
    estimates = {}
    for weight in (4.0, 64.0, 512.0):
        est = AcceptanceEstimator(2, [0.2, 1.0], None, prior_weight=weight, memory=1e12)
        for m, t in stream:
            est.observe_readouts(m, t)
        estimates[weight] = est.alpha[0]
        assert est.alpha[0] == pytest.approx((0.2 * weight + matches) / (weight + 64), rel=1e-6)
    assert abs(estimates[4.0] - 0.9) < abs(estimates[64.0] - 0.9) < abs(estimates[512.0] - 0.9)


def test_memory_forgets_the_prior():
    """Whatever the prior's weight, after many times `memory` positions the estimate is the readouts'."""
    rng = np.random.default_rng(3)
    for weight in (4.0, 4096.0):
        est = AcceptanceEstimator(2, [0.1, 1.0], None, prior_weight=weight, memory=64.0)
        for _ in range(400):
            est.observe_readouts(*readouts(rng, [0.8, 1.0], 4))
        assert est.alpha[0] == pytest.approx(0.8, abs=0.1), weight


def test_observe_drafts_moves_only_the_planned_depth():
    est = AcceptanceEstimator(4, [0.5, 0.6, 0.7, 1.0], None, prior_weight=16.0, memory=128.0)
    before = est.alpha.copy()
    est.observe_drafts(2, accepted=9, rejected=1)  # depth 2 drafted 10 checked tokens, 9 accepted
    after = est.alpha
    assert after[1] == pytest.approx((0.6 * 16 * 128 / 138 + 9) / (16 * 128 / 138 + 10))
    assert after[0] == before[0] and after[2] == before[2] and after[3] == 1.0
    assert est.positions == 10
    est.observe_drafts(1, accepted=0, rejected=3)
    assert est.alpha[0] < before[0] and est.alpha[1] == after[1]
    for d, accepted, rejected in [(0, 3, 1), (5, 3, 1), (3, 0, 0)]:  # no such depth, or nothing drafted
        est.observe_drafts(d, accepted, rejected)
    assert est.positions == 13


def test_readouts_without_trials_change_nothing():
    est = AcceptanceEstimator(3, [0.5, 0.6, 1.0], None, prior_weight=16.0, memory=128.0)
    est.observe_readouts([0, 0, 0], [0, 0, 0])
    est.observe_readouts([1, 1], [1, 1])  # not one count per depth
    assert list(est.alpha) == [0.5, 0.6, 1.0] and est.positions == 0


def switch_stream(seed: int, before: float, after: float, warm: int, batch: int = 4):
    rng = np.random.default_rng(seed)
    for _ in range(warm // batch):
        yield readouts(rng, [before, 0.6, 1.0], batch), False
    while True:
        yield readouts(rng, [after, 0.95, 1.0], batch), True


def test_a_switch_of_text_is_followed_within_the_memory():
    """After a switch of depth 1 from α = 0.3 to 0.9, the estimate crosses 0.7 within about its memory of positions
    (it forgets the old text as it fades, no detector needed) and settles near the new agreement."""
    for seed in (0, 1, 2):
        est = AcceptanceEstimator(3, [0.3, 0.6, 1.0], None, prior_weight=16.0, memory=128.0)
        after, crossed = 0, None
        for (matches, trials), switched in switch_stream(seed, 0.3, 0.9, 2000):
            est.observe_readouts(matches, trials)
            if not switched:
                assert est.alpha[0] < 0.7
                continue
            after += trials[0]
            if crossed is None and est.alpha[0] >= 0.7:
                crossed = after
            if after >= 1000:
                break
        # an exponential memory of 128 positions keeps e^-1 of the old text after 128 positions and a third
        # (what 0.7 allows) after ~141: the bound leaves room for the noise of 2000 positions before the switch
        assert crossed is not None and crossed <= 192, (seed, crossed)
        assert abs(est.alpha[0] - 0.9) < 0.06, (seed, est.alpha[0])


def test_tokens_read_the_planned_depth():
    est = AcceptanceEstimator(3, [0.3, 0.8, 1.0], [0.0, 0.5, 0.0], prior_weight=16.0, memory=128.0)
    tokens = est.tokens_upto(est.alpha, {1: 2, 2: 4})
    assert sorted(tokens) == [1, 2] and [len(tokens[1]), len(tokens[2])] == [3, 5]
    for k in range(5):
        assert tokens[2][k] == pytest.approx(float(markov_tokens(0.8, 0.5, k))), k
    assert tokens[1] == pytest.approx([1.0, markov_tokens(0.3, 0.0, 1), markov_tokens(0.3, 0.0, 2)])


def test_persistence_is_the_preset_s_and_readouts_move_only_the_agreement():
    """ρ is a property the tuner measures on its text; online only α is learned (docs/adaptive.md "What was removed":
    learning ρ from consecutive readouts moved the replayed goodput by −0.7 to +1.6 %). Readouts of a persistent
    chain move α towards the text's and leave ρ where the preset put it (clipped to [0, 1]; full depth 0)."""
    est = AcceptanceEstimator(3, [0.7, 0.8, 1.0], [0.0, 1.4, 0.3], prior_weight=16.0, memory=128.0)
    assert est.rho == [0.0, 1.0, 0.0]
    bits = markov_chain(0.4, 0.6, 4000, random.Random(4))
    for i in range(0, len(bits), 8):
        est.observe_readouts([sum(bits[i : i + 8]), 8, 8], [8, 8, 8])
    assert est.alpha[0] == pytest.approx(0.4, abs=0.08)
    assert est.rho == [0.0, 1.0, 0.0]


# --------------------------------------------------------------------------- the engine's readouts


@pytest.fixture(scope="module")
def tiny_ouro():
    from looped_spec import load_adapter

    return load_adapter("tiny-ouro", dtype="float32", device="cpu")


def test_engine_readouts_replay_to_the_speculative_rounds(tiny_ouro):
    """Greedy drafts are the depth-d readouts, so K-token rounds replayed on a plain run's depth-d bits commit
    exactly what a speculative engine commits, round for round."""
    from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig
    from looped_spec.tuning.acceptance_pass import measure_match_bits
    from looped_spec.tuning.prompt_sets import prompt_group

    prompts, tokens = prompt_group("code", 3), 32
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    depth = tiny_ouro.full_depth
    plain = LoopedSpecEngine(tiny_ouro, speculation=SpeculativeConfig(k=0, d=0, measure_depths=True))
    bits: list[list[list[int]]] = [[] for _ in range(depth)]
    outputs = []
    for prompt in prompts:
        seen = []
        plain.controller.observe = seen.append
        outputs.append(plain.generate([prompt], params)[0].token_ids)
        assert all(f.depth_trials == [1] * depth for f in seen)  # one position per round, every depth
        for d in range(depth):
            bits[d].append([f.depth_matches[d] for f in seen])
    assert all(len(seq) == tokens - 1 for seq in bits[0])
    assert all(bit == 1 for seq in bits[depth - 1] for bit in seq)  # greedy: full depth is the committed token
    assert measure_match_bits(tiny_ouro, prompts, tokens) == bits  # the tuner's pass reads the same bits
    for k, d in [(3, 1), (2, 2)]:
        engine = LoopedSpecEngine(tiny_ouro, speculation=SpeculativeConfig(k=k, d=d))
        outs = engine.generate(prompts, params)
        assert [o.token_ids for o in outs] == outputs
        for out, seq in zip(outs, bits[d - 1]):
            committed, rounds = simulate_tokens([seq], k)
            m = out.metrics
            assert (m.rounds, m.rounds + m.num_accepted_tokens) == (rounds, committed), (k, d, seq)
        total, rounds = simulate_tokens(bits[d - 1], k)
        assert sum(o.metrics.rounds for o in outs) == rounds and total == len(prompts) * (tokens - 1)
    # the bits are informative: depth 1 of a trained tiny model agrees often but not always
    alpha = bit_statistics(bits[0])[0]
    assert 0.2 < alpha < 1.0 and not math.isnan(alpha)


def test_the_acceptance_pass_is_greedy_whatever_the_checkpoint_samples_by_default(tmp_path):
    """A checkpoint whose generation_config.json samples by default is still measured along greedy trajectories:
    full depth then agrees with every committed token."""
    import json
    import shutil

    from conftest import fixture_dir

    from looped_spec import load_adapter
    from looped_spec.tuning.acceptance_pass import measure_match_bits

    folder = tmp_path / "sampling-ouro"
    shutil.copytree(fixture_dir("ouro"), folder)
    (folder / "generation_config.json").write_text(json.dumps({"do_sample": True, "temperature": 1.0}))
    adapter = load_adapter(str(folder), dtype="float32", device="cpu")
    bits = measure_match_bits(adapter, [[5, 6, 7, 8]], 12)
    assert bits[-1] == [[1] * 11]


# --------------------------------------------------------------------------- the batch's own agreement


def test_the_batch_alpha_pools_the_batch_requests_own_positions():
    """(Σ own matches + n·w·α) / (Σ own trials + n·w) over the batch's n requests, w = `request_prior`; requests
    outside the batch count for nothing, and full depth is 1."""
    est = AcceptanceEstimator(3, [0.5, 0.6, 1.0], None, prior_weight=16.0, memory=128.0, request_memory=1e12,
                              request_prior=2.0)  # fmt: skip
    est.observe_request_readouts(["fast", "slow", "gone"], [[4, 4, 4], [0, 1, 4], [4, 4, 4]], [4, 4, 4])
    est.set_batch(["fast", "slow"])
    overall = est.alpha
    expected = [(4 + 0 + 2 * 2 * overall[0]) / (8 + 4), (4 + 1 + 2 * 2 * overall[1]) / (8 + 4)]
    assert est.batch_alpha()[:2] == pytest.approx(expected)
    assert est.batch_alpha()[2] == 1.0
    est.set_batch(["slow"])
    assert est.batch_alpha()[0] == pytest.approx((0 + 2 * overall[0]) / (4 + 2))
    assert est.batch_alpha()[0] < overall[0]
    assert set(est.requests) == {"slow"}  # those that left the batch are dropped
    est.observe_request_readouts(["slow", "fast"], [[0, 0, 4], [4, 4, 4]], [4, 4])
    est.set_batch(["slow", "new"])  # one left and one came: a batch of the same size
    assert set(est.requests) == {"slow"}


def test_a_request_not_seen_yet_and_no_batch_stand_at_the_overall_estimate():
    est = AcceptanceEstimator(3, [0.5, 0.6, 1.0], None, prior_weight=16.0, memory=128.0)
    est.observe_readouts([3, 3, 4], [4, 4, 4])
    assert est.batch_alpha() == est.alpha  # no batch given (a caller that does not know its requests)
    est.set_batch(["new"])
    assert est.batch_alpha() == pytest.approx(est.alpha)


def test_a_request_s_drafts_count_the_accepted_and_the_rejection_at_the_planned_depth():
    est = AcceptanceEstimator(3, [0.5, 0.6, 1.0], None, prior_weight=16.0, memory=128.0, request_memory=1e12)
    est.observe_request_drafts(["all", "none", "idle"], 2, accepted=[3, 0, 0], proposed=[3, 2, 0])
    assert est.requests["all"] == [[0.0, 3.0, 0.0], [0.0, 3.0, 0.0]]  # every draft accepted: no rejection seen
    assert est.requests["none"] == [[0.0, 0.0, 0.0], [0.0, 1.0, 0.0]]  # rejected at the first draft
    assert "idle" not in est.requests  # proposed nothing
    est.observe_request_drafts(["all"], 4, [1], [2])  # no such draft depth: nothing
    assert est.requests["all"][1] == [0.0, 3.0, 0.0]


def test_a_request_s_own_estimate_remembers_about_request_memory_positions():
    """A request whose text changes agreement is followed within a few times its memory, whatever it agreed at
    before, while the overall estimate (128 positions, many requests) lags."""
    rng = np.random.default_rng(4)
    est = AcceptanceEstimator(2, [0.5, 1.0], None, prior_weight=16.0, memory=128.0, request_memory=16.0)
    est.set_batch(["a"])
    for truth in (0.9, 0.2):
        for _ in range(32):  # 128 positions, 8 memories
            m, t = readouts(rng, [truth, 1.0], 4)
            est.observe_request_readouts(["a"], [m], [t[0]])
            est.observe_readouts(*readouts(rng, [0.9, 1.0], 16))  # the rest of the traffic stays at 0.9
        assert est.batch_alpha()[0] == pytest.approx(truth, abs=0.15)
    assert est.alpha[0] > 0.8
