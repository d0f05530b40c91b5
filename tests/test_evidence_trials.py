"""Evidence trials: a speculative plan predicted near the best runs until its own rounds and probes price it
(control/goodput.py, docs/adaptive.md "Evidence trials")."""

from __future__ import annotations

import math
import statistics
from collections import deque

import pytest
from test_acceptance_cost import profiled_config
from test_probes import run_rounds

from looped_spec.control.controller import AdaptiveController
from looped_spec.control.goodput import (
    EVIDENCE_MARGIN,
    EVIDENCE_PAIRS,
    EVIDENCE_TRIAL_FROM,
    EVIDENCE_TRIAL_ROUNDS,
    EVIDENCE_TRIAL_SPACING,
    YOUNG_ROUNDS,
)
from looped_spec.control.probes import MAD_SIGMA, MEDIAN_SE, PROBE_EVERY, PROBE_Z, shrunk
from looped_spec.control.realized import REALIZED_MIN


def near_plain(alpha1: float = 0.55) -> AdaptiveController:
    """Plain and (2, 1); at α_1 = 0.55 the profile predicts (2, 1) at 1.01x plain: under the 5 % bar."""
    ctl = AdaptiveController(profiled_config([alpha1, 0.95, 0.99, 1.0], candidates=[[0, 0], [2, 1]]), 4)
    ctl.measure.fixed = 10**9  # no readouts: α_1 stays at the prior, every round is full shape
    ctl.measure.since = {False: 0, True: 0}
    return ctl


def rel(ctl: AdaptiveController) -> float:
    st = ctl.policy.states[0]
    return st.predicted[1] / st.predicted[st.plain]


def test_a_plan_near_plain_is_tried_after_the_young_phase_and_kept_on_its_evidence():
    ctl = near_plain()
    young = run_rounds(ctl, 1, YOUNG_ROUNDS, 1.0)
    assert young == [(0, 0)] * YOUNG_ROUNDS and 1.0 < rel(ctl) < 1.0 + ctl.policy.plain_margin
    plans = run_rounds(ctl, 1, EVIDENCE_TRIAL_ROUNDS + 60, 1.0)  # every draft accepted: 3 tokens a round
    start = plans.index((2, 1))
    trial = plans[start:]
    st = ctl.policy.states[0]
    ran = (st.next_trial - st.trial_started) // (EVIDENCE_TRIAL_SPACING + 1)  # rounds the trial ran
    assert st.trial == -1 and int(REALIZED_MIN) < ran < EVIDENCE_TRIAL_ROUNDS  # ended on evidence
    assert trial[:ran].count((0, 0)) >= EVIDENCE_PAIRS  # probed eagerly: one round in 4
    assert rel(ctl) > 1.2  # its own tokens: 3 a round where α_1 = 0.55 predicts 1.85
    after = trial[ran + 1 :]
    # kept, with a probe (two plain rounds) in PROBE_EVERY rounds
    assert len(after) > 16 and after.count((2, 1)) >= len(after) - 2 * (len(after) // PROBE_EVERY) - 2


def test_a_trial_that_commits_little_returns_to_plain_and_the_next_waits():
    ctl = near_plain()
    st = ctl.policy.states[0]
    run_rounds(ctl, 1, YOUNG_ROUNDS, 1.0)
    plans = run_rounds(ctl, 1, 200, 1.0, accept=[False])  # the plan's drafts are all rejected: 1 token a round
    first = plans.index((2, 1))
    ended = first + len(plans[first:]) - plans[first:][::-1].index((2, 1))
    assert plans[ended:] == [(0, 0)] * (200 - ended)  # plain again, and no second trial yet
    assert st.next_trial >= st.trial_started + EVIDENCE_TRIAL_SPACING * (ended - first) - 2


def test_a_plan_predicted_far_under_the_best_is_never_tried():
    ctl = near_plain(alpha1=0.4)
    run_rounds(ctl, 1, YOUNG_ROUNDS, 1.0)
    assert rel(ctl) < EVIDENCE_TRIAL_FROM
    assert run_rounds(ctl, 1, 400, 1.0) == [(0, 0)] * 400


def test_evidence_lowers_the_margin_over_plain():
    ctl = near_plain()
    policy = ctl.policy
    st = policy.states[0]
    rates = [100.0, 100.0 * (1.0 + (EVIDENCE_MARGIN + policy.plain_margin) / 2)]  # between the two margins
    st.current, st.predicted = 0, rates
    assert policy._eligible(st, rates) == [0]
    policy.realized.plans.add((2, 1), 3.0 * REALIZED_MIN, REALIZED_MIN)  # its own tokens ...
    assert policy._eligible(st, rates) == [0]  # ... but no probe pairs while within the probes' band
    policy.probes.ratios[(0, 2, 1)] = deque([1.0] * EVIDENCE_PAIRS)
    assert policy._eligible(st, rates) == [0, 1]
    st.current = 1  # in use, it keeps its place while predicted over plain, not below
    for rates, eligible in ([100.0, 100.5], [0, 1]), ([100.0, 99.5], [0]):
        st.predicted = rates
        assert policy._eligible(st, rates) == eligible


def test_a_plan_its_noisy_probes_price_must_clear_plain_by_their_standard_error():
    """Eight probe pairs with median 1.0: tight pairs leave the evidence margin as it is; pairs spread as on a
    machine whose speed moves between rounds raise the bar to PROBE_Z standard errors of their median."""
    ctl = near_plain()
    policy = ctl.policy
    st = policy.states[0]
    policy.realized.plans.add((2, 1), 3.0 * REALIZED_MIN, REALIZED_MIN)
    rates = [100.0, 100.0 * (1.0 + EVIDENCE_MARGIN + 0.005)]
    st.current, st.predicted = 0, rates
    tight = [0.99, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.01]
    policy.probes.ratios[(0, 2, 1)] = deque(tight)
    assert policy.probes.error(0, 2, 1) == pytest.approx(0.0) and policy._eligible(st, rates) == [0, 1]
    noisy = [0.85, 0.9, 0.95, 1.0, 1.0, 1.05, 1.1, 1.15]  # MAD 0.075: σ ≈ 0.11, the median's error ≈ 4.9 %
    policy.probes.ratios[(0, 2, 1)] = deque(noisy)
    error = policy.probes.error(0, 2, 1)
    logs = [math.log(x) for x in noisy]  # the pairs' spread is taken on the log scale
    mad = statistics.median(abs(x - statistics.median(logs)) for x in logs)
    assert error == pytest.approx(shrunk(statistics.median(logs), MEDIAN_SE * MAD_SIGMA * mad / 8**0.5)[1])
    assert 0.03 < error < MEDIAN_SE * MAD_SIGMA * mad / 8**0.5  # the prior narrows the pairs' own error
    assert policy.probes.factor(0, 2, 1) == pytest.approx(1.0) and PROBE_Z * error > EVIDENCE_MARGIN + 0.005
    assert policy._eligible(st, rates) == [0]
    rates = [100.0, 100.0 * (1.0 + PROBE_Z * error + 0.005)]  # clearing the wider bar
    st.predicted = rates
    assert policy._eligible(st, rates) == [0, 1]
    assert policy.probes.error(0, 3, 1) == 0.0 and policy.probes.error(0, 0, 0) == 0.0  # no pairs: no error


def test_the_bucket_decides_in_the_round_an_evidence_trial_ends(monkeypatch):
    """The decision on the evidence comes at once, not at the bucket's next scheduled decision (here far off)."""
    import looped_spec.control.goodput as goodput

    ctl = near_plain()
    policy = ctl.policy
    run_rounds(ctl, 1, YOUNG_ROUNDS, 1.0)
    monkeypatch.setattr(goodput, "MIN_DECISION_GAP", 10 * EVIDENCE_TRIAL_ROUNDS)
    ended, decided = [], []
    end, decide = policy._end_trial, policy._decide
    policy._end_trial = lambda st: (ended.append(st.rounds), end(st))
    policy._decide = lambda st, *args: (decided.append(st.rounds), decide(st, *args))
    run_rounds(ctl, 1, EVIDENCE_TRIAL_ROUNDS + 40, 1.0)
    assert ended and all(r in decided for r in ended)


def test_plain_decoding_tries_a_plan_whose_evidence_is_only_its_depths_error():
    """With plain decoding in use, a plan near it whose tokens rest on its depth's error (learned from other plans:
    no tokens of its own) is tried until it has its own; with a speculative plan in use the depth's error counts."""
    ctl = near_plain()
    policy = ctl.policy
    st = policy.states[0]
    run_rounds(ctl, 1, YOUNG_ROUNDS, 1.0)
    # the depth's error measured on BIAS_PRIOR expected accepted tokens, none of them (2, 1)'s own
    policy.realized.errors.add(1, 300.0, 300.0)
    policy.realized.errors.add(0, 300.0, 300.0)
    assert policy.realized.measured(2, 1) and not policy.realized.measured(2, 1, own=True)
    policy.probes.ratios[(0, 2, 1)] = deque([1.0] * EVIDENCE_PAIRS)
    assert st.options[st.current][0] == 0 and policy._has_evidence(st, 1)
    st.current = 1  # a speculative plan in use: (2, 1) itself has evidence, nothing to try
    policy._decide(st, 1)
    assert st.trial == -1
    st.current = 0  # plain decoding in use, (2, 1) priced within EVIDENCE_TRIAL_FROM of it: tried on its own tokens
    st.next_trial = 0
    policy._decide(st, 1)
    assert st.current == 0 and st.trial == 1 and st.trial_evidence
    plans = run_rounds(ctl, 1, EVIDENCE_TRIAL_ROUNDS, 1.0)
    assert plans.count((2, 1)) >= REALIZED_MIN and policy.realized.measured(2, 1, own=True)
    assert st.trial == -1 and 1 in st.evidence_tried  # ended on the plan's own tokens
