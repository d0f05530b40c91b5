"""Plain probes: a speculative plan's round cost against plain decoding's, side by side (control/probes.py)."""

from __future__ import annotations

import math
from collections import deque

import pytest
from test_acceptance_cost import profiled_config

from looped_spec.control.controller import AdaptiveController
from looped_spec.control.goodput import YOUNG_ROUNDS
from looped_spec.control.plan import RoundFeedback
from looped_spec.control.probes import (
    PROBE_BAND,
    PROBE_EVERY,
    PROBE_EVERY_NEW,
    PROBE_MIN,
    PROBE_WINDOW,
    RIVAL_EVERY,
    RIVAL_EVERY_MIN,
    CostProbes,
    rival_every,
    shrunk,
)


def test_probes_pair_a_plain_round_with_the_plans_next_round_of_the_same_shape():
    probes = CostProbes(1)
    due = []
    for plan_id in range(3 * PROBE_EVERY_NEW):
        due.append(probes.due(0, plan_id, 2, 1, 105.0, 100.0))
        if due[-1]:  # a probe is two plain rounds: an untimed lead-in, then the timed round
            assert probes.probe_plan[0] == (plan_id if not probes.lead[0] else -1) and not probes.idle(0)
    # a plan without PROBE_MIN pairs yet is probed every PROBE_EVERY_NEW rounds of its own
    every = PROBE_EVERY_NEW + 1
    assert [i for i, d in enumerate(due) if d] == [n * every + j for n in (0, 1) for j in (every - 2, every - 1)]
    far = CostProbes(1)  # a plan predicted beyond the band over plain is never probed
    assert not any(far.due(0, i, 2, 1, 100.0 * (1.0 + PROBE_BAND) + 1.0, 100.0) for i in range(4 * PROBE_EVERY))

    def probe_then(ratio_plain, ratio_plan, batch=8, plan_batch=8, full_shape=True, k=2):
        probes.since[0] = PROBE_EVERY - 1
        assert probes.due(0, 99, k, 1, 105.0, 100.0)  # the lead-in: its time is not taken
        probes.observe(0, 99, 0, 0, batch, 9.0, True)
        assert probes.due(0, 100, k, 1, 105.0, 100.0)
        probes.observe(0, 100, 0, 0, batch, ratio_plain, True)
        probes.observe(0, 101, k, 1, plan_batch, ratio_plan, full_shape)

    for _ in range(PROBE_MIN - 1):
        probe_then(0.5, 0.65)  # the machine runs at half the profile's time, the plan 30 % dearer than plain
    assert probes.factor(0, 2, 1) == 1.0  # not enough pairs yet
    probe_then(0.5, 0.65)
    assert probes.factor(0, 2, 1) == pytest.approx(1.3)
    probe_then(0.5, 5.0, plan_batch=7)  # another batch size: no pair
    probe_then(0.5, 5.0, full_shape=False)  # readouts or a cut draft in the plan's round: no pair
    probe_then(0.5, 5.0, k=3)  # pairs are per plan
    assert len(probes.ratios[(0, 2, 1)]) == PROBE_MIN and probes.factor(0, 3, 1) == 1.0
    probes.observe(0, 102, 2, 1, 8, 5.0, True)  # a round with no probe before it: nothing
    assert len(probes.ratios[(0, 2, 1)]) == PROBE_MIN
    assert probes.factor(0, 0, 0) == 1.0
    probes.since[0] = 0  # a plan with PROBE_MIN pairs: every PROBE_EVERY rounds
    due = [probes.due(0, plan_id, 2, 1, 105.0, 100.0) for plan_id in range(2 * PROBE_EVERY + 2)]
    assert [i for i, d in enumerate(due) if d] == [PROBE_EVERY - 1, PROBE_EVERY, 2 * PROBE_EVERY, 2 * PROBE_EVERY + 1]


def run_rounds(ctl: AdaptiveController, batch: int, rounds: int, plan_cost: float, accept=None) -> list:
    """Rounds whose seconds are the profile's, speculative ones `plan_cost` times dearer; request i accepts its
    whole draft if accept[i] (default: every request)."""
    policy = ctl.policy
    plans = []
    for _ in range(rounds):
        plan = ctl.plan(batch)
        plans.append((plan.k, plan.d))
        seconds = policy.profile.predict(plan.k, plan.d, batch) * (plan_cost if plan.k else 1.0)
        accepted = [plan.k if accept is None or accept[i] else 0 for i in range(batch)]
        ctl.observe(
            RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, batch, [plan.k] * batch,
                          accepted, full_depth_time=seconds)
        )  # fmt: skip
    return plans


def test_a_round_no_probe_counts_drops_a_probe_waiting_for_its_next_round():
    """A lead-in or a timed plain probe whose bucket then runs plain decoding as its plan is dropped: the pair would
    join rounds far apart, and while it waits the bucket takes no readouts (`wants`) and no quiet rounds (`idle`)."""
    probes = CostProbes(1)
    probes.since[0] = PROBE_EVERY_NEW - 1
    assert probes.due(0, 1, 2, 1, 105.0, 100.0) and probes.lead[0]  # the lead-in
    probes.interrupt(0)  # the policy switched to plain decoding
    assert probes.idle(0) and not probes.wants(0, 2)
    probes.since[0] = PROBE_EVERY_NEW - 1
    assert probes.due(0, 3, 2, 1, 105.0, 100.0) and probes.due(0, 4, 2, 1, 105.0, 100.0)  # lead-in, timed round
    probes.observe(0, 4, 0, 0, 8, 0.5, True)
    assert probes.wants(0, 5) and not probes.idle(0)
    probes.interrupt(0)
    assert probes.idle(0) and not probes.wants(0, 5)
    probes.observe(0, 6, 2, 1, 8, 0.6, True)  # a later round of the plan: no pair
    assert probes.pairs(0, 2, 1) == 0
    probes.since[0] = PROBE_EVERY_NEW - 1
    assert probes.due(0, 7, 2, 1, 105.0, 100.0) and probes.due(0, 8, 2, 1, 105.0, 100.0)
    probes.observe(0, 8, 0, 0, 8, 0.5, True)
    probes.observe(0, 9, 0, 0, 8, 0.5, True)  # a plain round right after a plain probe: dropped, not a pair
    assert probes.idle(0) and probes.ratios.get((0, 0, 0)) is None and probes.pairs(0, 2, 1) == 0
    # a rival probe is not dropped by plain decoding's interrupt: it pairs with the plan in use's next round
    probes.pending[0] = (8, 0.5, 3, 1)
    probes.interrupt(0)
    assert probes.pending[0] == (8, 0.5, 3, 1)


def test_goodput_drops_a_probe_when_it_leaves_the_plan_for_plain_decoding():
    """The policy interrupts the bucket's probes whenever the round it runs is plain decoding as its plan."""
    ctl = AdaptiveController(profiled_config([0.375, 0.95, 0.99, 1.0], candidates=[[0, 0], [1, 1]]), 4)
    ctl.measure.fixed = 10**9
    ctl.measure.since = {False: 0, True: 0}
    policy = ctl.policy
    st = policy.states[0]
    run_rounds(ctl, 8, 1, 1.0, [True] * 3 + [False] * 5)
    assert st.options[st.current][0] == 1
    policy.probes.since[0] = PROBE_EVERY_NEW - 1
    plan = ctl.plan(8)
    assert plan.k == 0 and policy.probes.lead[0]  # the lead-in of a probe of (1, 1)
    st.current = st.plain  # as a decision leaving (1, 1) would
    st.next_decision = st.rounds + 10**6
    st.paid_round = st.rounds + 10**6
    ctl.observe(RoundFeedback(plan.plan_id, 0, 0, 0, plan.candidate, 8, [0] * 8, [0] * 8, full_depth_time=1e-3))
    plan = ctl.plan(8)
    assert plan.k == 0 and policy.probes.idle(0) and not policy.times_round(0, plan.plan_id + 1)


@pytest.mark.parametrize("plan_cost", [1.0, 1.4])
def test_goodput_leaves_a_plan_its_probes_find_dearer_than_the_profile(plan_cost):
    """A plan near plain whose rounds cost 40 % more against plain than the profile says is left for plain
    decoding once PROBE_MIN probes (one in 4 rounds) have paired; one priced right keeps running, then with one
    plain round in 16."""
    ctl = AdaptiveController(profiled_config([0.375, 0.95, 0.99, 1.0], candidates=[[0, 0], [1, 1]]), 4)
    ctl.measure.fixed = 10**9  # no readouts: every round is full shape
    ctl.measure.since = {False: 0, True: 0}
    policy = ctl.policy
    st = policy.states[0]
    accept = [True] * 3 + [False] * 5  # 1.375 tokens per request-round: what α_1 = 0.375 predicts
    first = run_rounds(ctl, 8, 1, plan_cost, accept)
    assert first == [(1, 1)]
    assert st.predicted[0] * (1.0 + policy.plain_margin) < st.predicted[1] < st.predicted[0] * (1.0 + PROBE_BAND)
    plans = run_rounds(ctl, 8, PROBE_EVERY_NEW * PROBE_MIN + PROBE_EVERY * 2, plan_cost, accept)
    if plan_cost == 1.0:
        pairs = policy.probes.pairs(0, 1, 1)  # every probe two plain rounds (a lead-in and the timed one)
        assert plans.count((0, 0)) == 2 * pairs and pairs > PROBE_MIN
        assert policy.probes.factor(0, 1, 1) == pytest.approx(1.0)
    else:
        assert plans[-PROBE_EVERY:] == [(0, 0)] * PROBE_EVERY
        assert policy.probes.factor(0, 1, 1) == pytest.approx(plan_cost)


def test_goodput_does_not_probe_a_plan_far_above_plain():
    ctl = AdaptiveController(profiled_config([0.99, 0.995, 0.999, 1.0]), 4)
    plans = run_rounds(ctl, 1, 4 * PROBE_EVERY, 1.0)
    st = ctl.policy.states[0]
    assert max(st.predicted) > st.predicted[0] * (1.0 + PROBE_BAND)
    assert (0, 0) not in plans


def test_a_probe_and_the_round_priced_against_it_take_no_readouts():
    """Both rounds of a probe pair are timed in full shape: readouts due then wait for the round after."""
    ctl = AdaptiveController(profiled_config([0.375, 0.95, 0.99, 1.0], candidates=[[0, 0], [1, 1]]), 4)
    ctl.measure.fixed = 1  # every round would measure
    policy = ctl.policy
    rounds = []
    for _ in range(4 * PROBE_EVERY_NEW * PROBE_MIN):
        plan = ctl.plan(8)
        timed = policy.probes.wants(plan.bucket, plan.plan_id)
        rounds.append((plan.k, plan.measure_depths, timed))
        seconds = policy.profile.predict(plan.k, plan.d, 8)
        accepted = [plan.k] * 3 + [0] * 5
        n = 8 * (plan.k + 1) if plan.measure_depths else 0  # readouts agreeing as the prior says
        matches = [round(a * n) for a in (0.375, 0.95, 0.99, 1.0)] if n else []
        ctl.observe(
            RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, 8, [plan.k] * 8, accepted,
                          full_depth_time=seconds, depth_matches=matches, depth_trials=[n] * 4 if n else [])
        )  # fmt: skip
    probes = [i for i, (k, _, timed) in enumerate(rounds[:-1]) if k == 0 and timed]
    assert len(probes) >= PROBE_MIN
    for i in probes:
        assert not rounds[i][1]  # the probe: timed, no readouts
        assert rounds[i - 1][0] == 0 and not rounds[i - 1][2]  # after its lead-in: plain, not timed
        assert rounds[i + 1][0] == 1 and rounds[i + 1][2] and not rounds[i + 1][1]  # the plan's next round too
    assert [i for i, (k, _, _) in enumerate(rounds[:-1]) if k == 0] == sorted(probes + [i - 1 for i in probes])
    assert all(measured for _, measured, timed in rounds if not timed)  # every other round measured
    assert policy.probes.pairs(0, 1, 1) == len(probes)  # every probe paired


def test_a_rival_probe_prices_the_rival_against_the_plan_in_use_in_that_plans_factor():
    assert [rival_every(loss, 0) for loss in (0.0, 0.05, 0.15, 0.5)] == [RIVAL_EVERY_MIN, 5, 15, RIVAL_EVERY]
    assert rival_every(0.05, PROBE_MIN) == RIVAL_EVERY  # a rival with PROBE_MIN pairs
    probes = CostProbes(1)
    due = [probes.due_rival(0, plan_id, 5) for plan_id in range(15)]
    assert [i for i, d in enumerate(due) if d] == [4, 9, 14]
    probes.ratios[(0, 2, 2)] = deque([1.1] * PROBE_MIN)  # the plan in use: 10 % dearer than the profile says

    def rival_then(ratio_rival, ratio_plan, rival=(5, 1), plan=(2, 2), batch=1, plan_batch=1, full_shape=True):
        probes.since[0] = RIVAL_EVERY - 1
        assert probes.due_rival(0, 100, RIVAL_EVERY)
        probes.observe(0, 100, *rival, batch, ratio_rival, True)
        probes.observe(0, 101, *plan, plan_batch, ratio_plan, full_shape)

    for _ in range(PROBE_MIN):
        rival_then(0.35, 0.5)  # the rival's round 30 % cheaper against the profile than the plan's
    assert probes.factor(0, 5, 1) == pytest.approx(0.7 * 1.1)  # relative to plain, through the plan's factor
    assert probes.factor(0, 2, 2) == pytest.approx(1.1)  # the plan's own pairs are untouched
    assert probes.rival_pairs(0, 5, 1) == PROBE_MIN and probes.pairs(0, 5, 1) == 0  # kept apart from plain pairs
    rival_then(5.0, 0.5, plan_batch=2)  # another batch size: no pair
    rival_then(5.0, 0.5, full_shape=False)  # readouts or a cut draft in the plan's round: no pair
    rival_then(5.0, 0.5, plan=(5, 1))  # the rival again (a decision switched to it): no pair
    rival_then(5.0, 0.5, plan=(0, 0))  # plain decoding next: no pair, and nothing left waiting
    assert probes.idle(0) and probes.rival_pairs(0, 5, 1) == PROBE_MIN
    # plain pairs, where a plan has PROBE_MIN of them, price it against plain directly, whatever its rival pairs
    probes.ratios[(0, 5, 1)] = deque([0.9] * (PROBE_MIN - 1))
    assert probes.factor(0, 5, 1) == pytest.approx(0.7 * 1.1)
    probes.ratios[(0, 5, 1)].append(0.9)
    assert probes.factor(0, 5, 1) == pytest.approx(0.9) and probes.error(0, 5, 1) == 0.0


def run_priced(ctl: AdaptiveController, batch: int, rounds: int, cost: dict) -> list:
    """Rounds whose seconds are the profile's times cost[(K, d)] (default 1), every draft accepted, no readouts."""
    policy = ctl.policy
    plans = []
    for _ in range(rounds):
        plan = ctl.plan(batch)
        plans.append((plan.k, plan.d))
        seconds = policy.profile.predict(plan.k, plan.d, batch) * cost.get((plan.k, plan.d), 1.0)
        ctl.observe(
            RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, batch, [plan.k] * batch,
                          [plan.k] * batch, full_depth_time=seconds)
        )  # fmt: skip
    return plans


@pytest.mark.parametrize("rival_cost", [1.0, 0.75])
def test_goodput_moves_to_a_rival_far_above_plain_that_its_rival_probes_find_cheaper(rival_cost):
    """Every plan is far above plain (no plain probes). A rival predicted a little under the plan in use whose rounds
    cost 25 % less against the plan's than the profile says is run once rival probes have priced it; one priced
    right only gets its probe rounds, then one in RIVAL_EVERY."""
    ctl = AdaptiveController(profiled_config([0.99, 0.995, 0.999, 1.0], candidates=[[0, 0], [3, 1], [5, 1]]), 4)
    ctl.measure.fixed = 10**9  # no readouts: every round is full shape
    ctl.measure.since = {False: 0, True: 0}
    policy = ctl.policy
    st = policy.states[0]
    young = run_priced(ctl, 1, YOUNG_ROUNDS, {})
    assert set(young) == {young[0]}  # no rival probes while acceptance is young
    current = st.options[st.current][:2]
    rival = st.options[policy._rival(st, st.current)][:2]
    assert st.predicted[0] * (1.0 + PROBE_BAND) < min(st.predicted[1:])
    assert rival != current and rival[0] > 0
    plans = run_priced(ctl, 1, RIVAL_EVERY * PROBE_MIN + RIVAL_EVERY * 3, {rival: rival_cost})
    assert (0, 0) not in plans
    if rival_cost == 1.0:
        assert policy.probes.factor(0, *rival) == pytest.approx(1.0)
        assert st.options[st.current][:2] == current
        assert plans[-RIVAL_EVERY * 3 :].count(rival) <= 3  # one in RIVAL_EVERY once it has pairs
    else:
        assert policy.probes.factor(0, *rival) == pytest.approx(rival_cost)
        assert st.options[st.current][:2] == rival and plans[-8:] == [rival] * 8


def test_an_undecided_rival_is_probed_often_until_its_pairs_can_decide():
    """A rival its few pairs price a little over the plan in use, inside the error bar of so few pairs, is probed
    first and every RIVAL_EVERY_MIN rounds (not RIVAL_EVERY) until it has PROBE_WINDOW pairs; with them the bar
    narrows and the decision takes it."""
    assert rival_every(-0.05, PROBE_MIN, undecided=True) == RIVAL_EVERY_MIN
    assert rival_every(-0.05, PROBE_MIN) == RIVAL_EVERY
    ctl = AdaptiveController(profiled_config([0.99, 0.995, 0.999, 1.0], candidates=[[0, 0], [3, 1], [5, 1]]), 4)
    ctl.measure.fixed = 10**9  # no readouts
    ctl.measure.since = {False: 0, True: 0}
    policy = ctl.policy
    policy.probe_prior = False  # factors as the pairs' median, so the test can set one (the prior: test_probe_prior)
    st = policy.states[0]
    run_priced(ctl, 1, YOUNG_ROUNDS, {})
    current = st.current
    rival = policy._rival(st, current)
    k, d, _ = st.options[rival]
    assert policy._rival_every(st, current, rival) > RIVAL_EVERY_MIN  # predicted under the plan: the budget's rate
    # four noisy pairs whose median prices the rival 4 % over the plan in use
    factor = st.predicted[rival] / (1.04 * st.predicted[current])
    policy.probes.rival_ratios[(0, k, d)] = deque(factor * x for x in (0.8, 1.0, 1.0, 1.2))
    policy._decide(st, 1)
    assert st.current == current and st.predicted[rival] == pytest.approx(1.04 * st.predicted[current], rel=0.01)
    assert policy._bar(st, rival) > 1.04  # the error bar of four pairs keeps the plan in use
    assert policy._rival(st, current) == rival
    assert policy._rival_every(st, current, rival) == RIVAL_EVERY_MIN
    policy.probes.rival_ratios[(0, k, d)].extend([factor] * (PROBE_WINDOW - PROBE_MIN))
    policy.undecided_rivals = False  # the switch (an A/B in bench_speculative.py): back to one in RIVAL_EVERY
    assert policy._rival_every(st, current, rival) == RIVAL_EVERY
    policy.undecided_rivals = True
    policy._decide(st, 1)
    assert st.current == rival  # sixteen pairs: the bar is the hysteresis, and the rival clears it


def numeric_posterior(median: float, se: float) -> tuple[float, float]:
    """Posterior mean and sd of the log cost error on a fine grid: prior density (the two-part mixture) times the
    likelihood of the median, integrated numerically (independent of `shrunk`'s closed form)."""
    import numpy as np

    from looped_spec.control.probes import PRIOR_FAR, PRIOR_NEAR, PRIOR_NEAR_WEIGHT

    x = np.linspace(-2.0, 2.0, 400_001)

    def normal(v, sd):
        return np.exp(-0.5 * (v / sd) ** 2) / sd

    prior = PRIOR_NEAR_WEIGHT * normal(x, PRIOR_NEAR) + (1.0 - PRIOR_NEAR_WEIGHT) * normal(x, PRIOR_FAR)
    weight = prior * normal(x - median, se)
    mean = float((weight * x).sum() / weight.sum())
    return mean, float(np.sqrt((weight * (x - mean) ** 2).sum() / weight.sum()))


@pytest.mark.parametrize("median,se", [(-0.066, 0.047), (-0.26, 0.09), (-0.26, 0.045), (0.1, 0.03), (0.02, 0.2)])
def test_probe_prior_is_the_posterior_of_a_two_part_prior(median, se):
    mean, sd = shrunk(median, se)
    ref_mean, ref_sd = numeric_posterior(median, se)
    assert mean == pytest.approx(ref_mean, abs=1e-4) and sd == pytest.approx(ref_sd, abs=1e-4)


def test_probe_prior_pulls_a_median_near_the_profile_back_and_keeps_one_far_from_it():
    """A median one or two standard errors from the profile (noise on this machine) moves the price by a fraction
    of itself; one many standard errors out (the profile of another day) is kept nearly whole; pairs without
    spread are taken as they are."""
    near, _ = shrunk(math.log(0.937), 0.047)  # tiny-ouro (4, 1) at B = 1: 16 pairs 1.4 standard errors under
    assert abs(near) < 0.6 * abs(math.log(0.937))
    far, _ = shrunk(math.log(0.77), 0.045)  # 30 % off, 6 standard errors
    assert far == pytest.approx(math.log(0.77), rel=0.05)
    assert shrunk(0.05, 0.0) == (pytest.approx(0.05), 0.0)
    probes = CostProbes(1)
    probes.ratios[(0, 2, 1)] = deque([0.8, 0.9, 0.95, 1.0, 1.05])  # median 0.95, spread wide
    assert 0.95 < probes.factor(0, 2, 1) < 1.0 and probes.error(0, 2, 1) > 0.0
    probes.prior = False  # the switch (an A/B): the median as it is
    assert probes.factor(0, 2, 1) == pytest.approx(0.95)
