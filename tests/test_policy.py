"""The EMA-threshold policy: exact EMA values, moves, min_samples/interval and bucket isolation."""

from __future__ import annotations

import pytest

from looped_spec.control import AdaptiveController, AdaptiveSpecConfig
from looped_spec.control.plan import RoundFeedback, SpeculationPlan


def make(buckets: list[dict], disable: dict | None = None, full_depth: int = 4) -> AdaptiveController:
    data = {"model": "t", "buckets": buckets, "disable": disable or {"enabled": False}, "provenance": "test"}
    return AdaptiveController(AdaptiveSpecConfig.parse(data), full_depth, policy="ema")


def bucket(lo: int, hi: int | None, candidates, **knobs) -> dict:
    out = {"min_batch": lo, "max_batch": hi, "candidates": candidates, "theta_up": 0.8, "theta_down": 0.4}
    out.update(knobs)
    return out


def feed(plan: SpeculationPlan, accepted: list[int], proposed: list[int] | None = None, batch: int | None = None):
    proposed = proposed if proposed is not None else [plan.k] * len(accepted)
    return RoundFeedback(
        plan_id=plan.plan_id,
        k=plan.k,
        d=plan.d,
        bucket=plan.bucket,
        candidate=plan.candidate,
        batch_size=batch if batch is not None else len(accepted),
        num_proposed=proposed,
        num_accepted=accepted,
    )


def state(ctl: AdaptiveController, b: int = 0):
    return ctl.policy.states[b]


def test_ema_values_by_hand():
    ctl = make([bucket(1, None, [[2, 2], [3, 1]], beta=0.5, min_samples=100)])
    # round 1: ΣA/ΣK = (1 + 0) / (2 + 2) = 0.25 -> E = r (no prior)
    # round 2: (2 + 2) / 4 = 1.0 -> E = 0.5 * 0.25 + 0.5 * 1.0 = 0.625
    # round 3: ΣK = 0 -> skipped
    # round 4: (1 + 1 + 0) / (2 + 2 + 2) = 1/3 -> E = 0.5 * 0.625 + 0.5 / 3
    expected = [0.25, 0.625, 0.625, 0.5 * 0.625 + 0.5 / 3]
    rounds = [([1, 0], None), ([2, 2], None), ([0, 0], [0, 0]), ([1, 1, 0], None)]
    for (acc, prop), e in zip(rounds, expected):
        plan = ctl.plan(len(acc))
        ctl.observe(feed(plan, acc, prop))
        assert state(ctl).ema[0] == pytest.approx(e, abs=1e-12)
    assert state(ctl).samples == [3, 0]


def test_prior_initialises_the_ema():
    ctl = make([bucket(1, None, [{"k": 2, "d": 2, "prior": 0.6}, [3, 1]], beta=0.25, min_samples=100)])
    assert state(ctl).ema == [0.6, None]
    plan = ctl.plan(1)
    ctl.observe(feed(plan, [2]))  # r = 1.0 -> 0.75 * 0.6 + 0.25 * 1.0
    assert state(ctl).ema[0] == pytest.approx(0.7)


def test_moves_min_samples_and_interval():
    # beta = 1: E is the last round's rate, so every decision is easy to predict
    ctl = make([bucket(1, None, [[2, 3], [4, 2], [4, 1]], beta=1.0, min_samples=3, interval=2)])
    trail = []
    script = [1.0, 1.0, 1.0] + [0.0, 0.0, 0.0] + [0.5, 0.5, 0.5, 1.0, 1.0]
    for r in script:
        plan = ctl.plan(1)
        ctl.observe(feed(plan, [int(r * plan.k)], [plan.k]))
        assert state(ctl).ema[plan.candidate] == r
        trail.append(state(ctl).index)
    # 3 samples at 0 -> up; 3 samples of 0.0 at 1 -> down; at 0: visit 3 (r=0.5, stay),
    # visit 4 (r=1.0) is between decisions (interval 2), visit 5 (r=1.0) -> up
    assert trail == [0, 0, 1, 1, 1, 0, 0, 0, 0, 0, 1]


def test_never_leaves_the_list():
    ctl = make([bucket(1, None, [[1, 2], [2, 1]], beta=1.0, min_samples=1, interval=1, initial_index=1)])
    for _ in range(5):
        plan = ctl.plan(1)
        ctl.observe(feed(plan, [plan.k]))
        assert state(ctl).index == 1
    for _ in range(5):
        plan = ctl.plan(1)
        ctl.observe(feed(plan, [0]))
    assert state(ctl).index == 0  # moved down once, then stays: no K=0 and Phase 2 disabled
    assert not state(ctl).off


def test_bucket_isolation_when_batch_moves_before_feedback():
    ctl = make(
        [
            bucket(1, 4, [[1, 2], [2, 1]], beta=0.5, min_samples=100),
            bucket(5, None, [[1, 3], [2, 2]], beta=0.5, min_samples=100),
        ]
    )
    p0 = ctl.plan(2)  # bucket 0
    p1 = ctl.plan(8)  # the batch grew: bucket 1
    assert (p0.bucket, p1.bucket) == (0, 1)
    ctl.observe(feed(p1, [0] * 8))  # feedback arrives late and out of order
    ctl.observe(feed(p0, [1, 1], batch=8))  # batch_size of the feedback is irrelevant for routing
    assert state(ctl, 0).ema == [1.0, None] and state(ctl, 0).samples == [1, 0]
    assert state(ctl, 1).ema == [0.0, None] and state(ctl, 1).samples == [1, 0]


def test_stale_candidate_feedback_updates_its_own_ema_only():
    ctl = make([bucket(1, None, [[1, 2], [2, 1]], beta=1.0, min_samples=1, interval=1)])
    p_old = ctl.plan(1)  # candidate 0
    p_new = ctl.plan(1)  # still candidate 0 (no feedback yet)
    ctl.observe(feed(p_new, [1]))  # r = 1 > 0.8: move up to candidate 1
    assert state(ctl).index == 1
    ctl.observe(feed(p_old, [0]))  # candidate 0's feedback after the move: its EMA only, no decision
    st = state(ctl)
    assert st.index == 1 and st.ema[0] == 0.0 and st.ema[1] is None and st.visit == 0


def test_feedback_without_bucket_is_ignored():
    ctl = make([bucket(1, None, [[1, 2]], min_samples=1)])
    ctl.observe(RoundFeedback(0, 1, 2, -1, -1, 1, [1], [1]))
    assert state(ctl).samples == [0]
