"""Drain pricing (control/drain.py): a plan priced by the time to finish the running requests when nothing waits."""

from __future__ import annotations

import itertools
import statistics

import numpy as np
import pytest
from conftest import make_engine
from test_acceptance_cost import synthetic_times

from looped_spec import SamplingParams
from looped_spec.control import AdaptiveController, AdaptiveSpecConfig, OffController
from looped_spec.control.acceptance import markov_tokens, markov_tokens_array
from looped_spec.control.costprofile import CostProfile
from looped_spec.control.drain import QUANTILES, drain_factor, drain_seconds, request_rates, slice_z, slices
from looped_spec.control.goodput import EVIDENCE_TRIAL_FROM
from looped_spec.tuning.tuner import acceptance_report


def enumerated_drain(remaining, rates, per_request_second):
    """Reference: every assignment of an equally likely rate to each request, the batch run round by round
    (continuous rounds) with a cost of `per_request_second` per running request; the mean over assignments."""
    total = 0.0
    assignments = list(itertools.product(rates, repeat=len(remaining)))
    for speeds in assignments:
        finish = sorted(r / s for r, s in zip(remaining, speeds))
        previous, seconds = 0.0, 0.0
        for j, f in enumerate(finish):
            seconds += (f - previous) * per_request_second * (len(finish) - j)
            previous = f
        total += seconds
    return total / len(assignments)


def test_drain_seconds_equals_enumerating_every_assignment():
    """With a cost proportional to the running requests, E[cost(n)] = cost(E[n]): the model is exact."""
    rates = [1.2, 1.9, 2.6, 3.1]
    remaining = [64, 40, 10]
    cost = 0.002 * np.arange(len(remaining) + 1)  # [B+1]: 2 ms per running request
    expected = enumerated_drain(remaining, rates, 0.002)
    assert drain_seconds(remaining, rates, cost) == pytest.approx(expected, rel=1e-12)
    # ... and its closed form: sum over requests of remaining · E[1 / rate] · 2 ms
    assert expected == pytest.approx(0.002 * sum(remaining) * statistics.mean(1 / r for r in rates))


def test_drain_factor_is_one_in_lockstep_and_below_one_when_requests_spread():
    cost = np.array([0.0, 4.0, 5.0, 6.0, 7.0])  # a round's cost grows less than its batch
    assert drain_factor([64] * 4, [1.0] * QUANTILES, 1.0, cost) == pytest.approx(1.0)  # plain, equal budgets
    assert drain_factor([64] * 4, [2.5] * QUANTILES, 2.5, cost) == pytest.approx(1.0)  # no spread: lockstep
    spread = request_rates(0.7, 0.2, 0.1, 3)
    assert len(spread) == QUANTILES and list(spread) == sorted(spread)
    factor = drain_factor([64] * 4, spread, statistics.mean(spread), cost)
    assert 0.5 < factor < 0.95
    # a wider spread drains slower
    wider = request_rates(0.7, 0.3, 0.1, 3)
    assert drain_factor([64] * 4, wider, statistics.mean(wider), cost) < factor
    # plain decoding of unequal budgets leaves slots empty too
    assert drain_factor([64, 8, 8, 8], [1.0] * QUANTILES, 1.0, cost) < 0.7


def test_request_rates_spread_agreement_over_normal_slices():
    for count in (QUANTILES, 64):
        z = slice_z(count)
        assert list(z) == sorted(z) and sum(z) == pytest.approx(0.0, abs=1e-12)
        assert statistics.NormalDist().cdf(z[0]) == pytest.approx(0.5 / count)
    assert list(request_rates(0.7, 0.0, 0.0, 2)) == [pytest.approx(1 + 0.7 + 0.49)] * QUANTILES
    assert list(request_rates(0.5, 0.2, 0.0, 0)) == [1.0]  # plain: one token a round whatever the text
    assert max(request_rates(0.95, 0.5, 0.0, 3)) == pytest.approx(4.0)  # agreement clipped at 1
    assert slices(1) == slices(4) == QUANTILES and slices(32) == 64 and slices(1000) == 128


def test_the_vectorized_chain_equals_the_scalar_one():
    alphas = np.array([0.0, 0.2, 0.55, 0.9, 1.0, 1.3, -0.1])
    for rho in (0.0, 0.3, 0.9, 1.0):
        for k in (1, 2, 5):
            want = [markov_tokens(float(a), rho, k) for a in alphas]
            assert markov_tokens_array(alphas, rho, k) == pytest.approx(want, rel=1e-12)


def test_drain_slices_grow_with_the_batch_to_reach_its_slowest_request():
    """Of B requests the slowest sits near z = −2 at B = 32, past 8 slices' outermost midpoint (−1.53): with
    2·B slices the drain time matches a Monte Carlo over continuous z (the reference) within 1 %, with 8 it
    is several percent short for a wide spread."""
    rng = np.random.default_rng(0)
    batch, alpha, spread, rho, k = 32, 0.6, 0.2, 0.3, 2
    cost = np.concatenate([[0.0], 0.004 + 0.0005 * np.arange(1, batch + 1)])  # [B+1] affine in n past 0
    remaining = [64] * batch
    z = rng.standard_normal((4000, batch))
    speed = markov_tokens_array(alpha + spread * z, rho, k)  # [draws, B]
    finish = np.sort(64 / speed, axis=1)
    rounds = np.diff(finish, axis=1, prepend=0.0)  # [draws, B] rounds run with B - j requests
    reference = float((rounds * cost[batch - np.arange(batch)]).sum(axis=1).mean())
    wide = drain_seconds(remaining, request_rates(alpha, spread, rho, k, slices(batch)), cost)
    narrow = drain_seconds(remaining, request_rates(alpha, spread, rho, k, QUANTILES), cost)
    assert wide == pytest.approx(reference, rel=0.01)
    assert narrow < 0.98 * reference


def drain_config(spread, alpha=(0.7, 0.9, 0.95, 1.0)) -> AdaptiveSpecConfig:
    """One bucket for every batch size: plain and (3, 1); a profile whose round at B = 8 costs 3.75x B = 1."""
    profile = CostProfile.fit(4, {1: 0.008, 8: 0.03}, synthetic_times(4, 0.0, 0))
    bucket = {"min_batch": 1, "max_batch": None, "candidates": [[0, 0], [3, 1]], "initial_index": 0}
    bucket.update(theta_up=0.9, theta_down=0.1)
    acceptance = {"alpha": list(alpha), "rho": [0.0] * 4, "positions": 100}
    if spread is not None:
        acceptance["spread"] = spread
    return AdaptiveSpecConfig.parse(
        {"model": "t", "full_depth": 4, "buckets": [bucket], "acceptance": acceptance, "cost": profile.to_dict()}
    )


def test_goodput_prices_draining_only_when_nothing_waits():
    ctl = AdaptiveController(drain_config([0.25, 0.2, 0.1, 0.0]), 4)
    policy = ctl.policy
    st = policy.states[0]
    per_round = policy.rates(st, 8)
    drained = policy.rates(st, 8, None, [64] * 8)
    assert per_round[1] > 1.15 * per_round[0]  # per round (3, 1) pays over the margin ...
    assert drained[0] == pytest.approx(per_round[0])  # plain with equal budgets stays in step
    assert drained[1] < 1.05 * drained[0]  # ... drained, requests of different texts spread apart: it does not
    assert ctl.plan(8, None, [64] * 8).k == 0
    assert ctl.stats()["buckets"][0]["drain_priced"] is True and ctl.uses_budgets
    fresh = AdaptiveController(drain_config([0.25, 0.2, 0.1, 0.0]), 4)
    assert fresh.plan(8).k == 3  # requests wait (no budgets passed): slots are refilled, per-round pricing
    # a single request, or a preset without a measured spread, is priced per round
    assert AdaptiveController(drain_config([0.25, 0.2, 0.1, 0.0]), 4).plan(1, None, [64]).k == 3
    assert AdaptiveController(drain_config(None), 4).plan(8, None, [64] * 8).k == 3
    assert not AdaptiveController(drain_config(None), 4).uses_budgets  # the engine builds no budgets for it
    # an option under EVIDENCE_TRIAL_FROM of plain per round is left unpriced (draining would only lower it
    # further: it can be neither eligible nor tried) ...
    low = AdaptiveController(drain_config([0.25, 0.2, 0.1, 0.0], alpha=(0.3, 0.9, 0.95, 1.0)), 4).policy
    per_round, drained = low.rates(low.states[0], 8), low.rates(low.states[0], 8, None, [64] * 8)
    assert per_round[1] < EVIDENCE_TRIAL_FROM * per_round[0] and drained == per_round
    # ... one above it is priced even under plain's eligibility bar: its drained price ranks it for trials
    near = AdaptiveController(drain_config([0.25, 0.2, 0.1, 0.0], alpha=(0.58, 0.9, 0.95, 1.0)), 4).policy
    per_round, drained = near.rates(near.states[0], 8), near.rates(near.states[0], 8, None, [64] * 8)
    assert EVIDENCE_TRIAL_FROM < per_round[1] / per_round[0] < 1.0 + near.plain_margin
    assert drained[1] / drained[0] < 0.9 * per_round[1] / per_round[0]


def test_spread_must_have_one_entry_per_depth():
    with pytest.raises(ValueError, match="spread has 2 depths but alpha has 4"):
        drain_config([0.1, 0.2])
    with pytest.raises(ValueError, match="spread"):
        drain_config([0.1, 0.2, 0.9, 0.0])  # over 0.5: not a standard deviation of a share


class BudgetRecorder(OffController):
    uses_budgets = True

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[list[int] | None] = []

    def plan(self, num_running, context=None, remaining=None):
        self.seen.append(None if remaining is None else list(remaining))
        return super().plan(num_running, context, remaining)


def test_engine_passes_budgets_left_only_when_nothing_waits():
    engine = make_engine("ouro", max_batch_size=1)
    engine.controller = recorder = BudgetRecorder()
    engine.generate([[5, 6, 7], [8, 9, 10, 11]], SamplingParams(max_tokens=4, ignore_eos=True))
    # the first request decodes while the second waits; then the second alone, nothing waiting:
    # budgets after prefill's token: 3, 2, 1 tokens left
    assert recorder.seen == [None, None, None, [3], [2], [1]]


def test_tuner_reports_the_spread_of_per_prompt_agreement():
    bits = [[[1, 1, 0, 1], [0, 0, 1], [1, 1, 1, 1, 1]], [[1, 1, 1, 1], [1, 1, 1], [1, 1, 1, 1, 1]]]
    report = acceptance_report(bits, [(1, 1)])
    assert report["spread"][0] == pytest.approx(statistics.pstdev([0.75, 1 / 3, 1.0]), abs=1e-4)
    assert report["spread"][1] == 0.0


def test_engine_passes_no_budgets_to_a_batch_that_took_a_request_in_while_decoding():
    """A static batch (admitted together) is drain-priced; once a request joins while others decode, the batch
    is open - a server's - and is priced per round even when nothing waits; a batch of one is static."""
    engine = make_engine("ouro", max_batch_size=4)
    engine.controller = recorder = BudgetRecorder()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine.add_request([5, 6, 7], params)
    engine.add_request([8, 9, 10, 11], params)
    for _ in range(3):  # prefill, then two decode rounds of the pair
        engine.step()
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    # the pair: 5 and 4 tokens left; with the newcomer (open): three rounds unpriced; then the newcomer alone
    assert recorder.seen == [[5, 5], [4, 4], None, None, None, [4], [3], [2], [1]]
