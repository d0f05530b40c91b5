"""The goodput policy under early exit (control/exits.py): drafts that exit within the draft depth always
pass, and in skip mode the loops early exit saves make rounds cheaper, both from the bucket's exit depths."""

from __future__ import annotations

import pytest
from test_acceptance_cost import profiled_config

from looped_spec.control import AdaptiveController
from looped_spec.control.costprofile import CostProfile
from looped_spec.control.exits import ExitDepths
from looped_spec.control.plan import RoundFeedback
from looped_spec.control.realized import RealizedTokens


def one_size_profile() -> CostProfile:
    """D = 4 at B = 1 with known terms: c_shallow 1, v_0 0.5, v_1 1, other 1 (seconds)."""
    return CostProfile(4, [1], [5.0], [[1.0, 0.5, 1.0, 1.0]])


def test_exit_depths_give_the_effective_acceptance_and_the_saved_loops():
    exits = ExitDepths(4)
    exits.observe([2, 2, 2, 2], skips=True)
    profile = one_size_profile()
    assert exits.exit_within(1) == 0.0 and exits.exit_within(2) == 1.0
    assert exits.effective_alpha(0.3, 1) == pytest.approx(0.3)
    assert exits.effective_alpha(0.3, 2) == pytest.approx(1.0)
    # plain: loop part 4 x 1 runs 2 of 4 loops, other 1 -> (2 + 1) / (4 + 1)
    assert exits.cost_factor(profile, 0, 0, 1, None) == pytest.approx(3 / 5)
    # (K=1, d=1): draft 2 (all of d run), verify fixed 1.5, verify per query 6 x (2-1)/3, other 1
    assert exits.cost_factor(profile, 1, 1, 1, None) == pytest.approx((2 + 1.5 + 2 + 1) / 10.5)
    # (K=1, d=3): draft 6 x 2/3; every position exits within d, so no verify pass at all; other 1
    assert exits.cost_factor(profile, 1, 3, 1, None) == pytest.approx((4 + 0 + 0 + 1) / 9.5)
    exits.observe([2], skips=False)  # select mode runs every loop: no saving
    assert exits.cost_factor(profile, 1, 1, 1, None) == 1.0


def feedback(plan, exit_depths, skips=True, accepted=0):
    return RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, 1, [plan.k], [accepted],
                         exit_depths=exit_depths, exit_skips=skips)  # fmt: skip


def test_goodput_speculates_when_tokens_exit_within_the_draft_depth():
    """Zero verified acceptance keeps plain decoding; when every token exits at depth 1, a d >= 1 draft is
    the target itself and speculation pays."""
    ctl = AdaptiveController(profiled_config([0.0, 0.0, 0.0, 1.0]), 4)
    assert ctl.plan(1).k == 0
    for _ in range(50):
        ctl.observe(feedback(ctl.plan(1), [4]))  # full-depth tokens: nothing changes
    assert ctl.plan(1).k == 0
    for _ in range(400):  # the histogram's memory is about 200 rounds
        ctl.observe(feedback(ctl.plan(1), [1]))
    plan = ctl.plan(1)
    assert plan.k > 0 and plan.d >= 1
    described = ctl.policy.states[0]
    assert described.exits is not None and described.exits.exit_within(1) > 0.9


def test_rounds_without_early_exit_leave_the_prediction_unchanged():
    config = profiled_config([0.5, 0.6, 0.7, 1.0])
    with_fb, without = AdaptiveController(config, 4), AdaptiveController(config, 4)
    for _ in range(20):
        plan = with_fb.plan(1)
        with_fb.observe(feedback(plan, []))
    st_a, st_b = with_fb.policy.states[0], without.policy.states[0]
    assert not st_a.exits.seen
    with_fb.policy.realized = RealizedTokens()  # what the plans committed is learned from every round (test_goodput)
    assert with_fb.policy.rates(st_a, 1) == without.policy.rates(st_b, 1)


def test_rounds_with_early_exit_teach_acceptance_from_their_verified_drafts():
    """Early-exit rounds take no counterfactual readouts; their verified drafts (all accepted here) are what
    the policy learns α_d from."""
    ctl = AdaptiveController(profiled_config([0.0, 0.0, 0.0, 1.0]), 4)
    policy = ctl.policy
    assert policy.acceptance.alpha(1) == pytest.approx(0.0)
    for i in range(200):
        fb = RoundFeedback(i, 2, 1, 0, 1, 1, [2], [2], exit_depths=[4, 4, 4], exit_skips=True)
        ctl.observe(fb)
    assert policy.acceptance.alpha(1) > 0.9
    before = policy.acceptance.alpha(2)
    ctl.observe(RoundFeedback(300, 2, 2, 0, 1, 1, [2], [2]))  # no exits, no counterfactuals: not a measurement
    assert policy.acceptance.alpha(2) == before
