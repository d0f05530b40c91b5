"""Controllers: plan ids and buckets, Phase 2 off/probe backoff/re-enable, fixed/off controllers, trace, stats."""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import pytest

from looped_spec.control import AdaptiveController, AdaptiveSpecConfig, FixedController, OffController
from looped_spec.control.plan import RoundFeedback, SpeculationPlan


def config(buckets: list[dict], **disable) -> AdaptiveSpecConfig:
    return AdaptiveSpecConfig.parse({"model": "t", "buckets": buckets, "disable": disable, "provenance": "test"})


def bucket(lo: int, hi: int | None, candidates, **knobs) -> dict:
    out = {"min_batch": lo, "max_batch": hi, "candidates": candidates, "theta_up": 0.8, "theta_down": 0.1}
    out.update(beta=1.0, min_samples=2, interval=1)
    out.update(knobs)
    return out


def run(ctl: AdaptiveController, batch: int, rate: float, seconds: float = 0.0) -> SpeculationPlan:
    """One round where every request accepts round(rate * k) tokens and the round takes `seconds`."""
    plan = ctl.plan(batch)
    acc = [round(rate * plan.k)] * batch
    ctl.observe(
        RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, batch, [plan.k] * batch, acc, seconds)
    )
    return plan


def plain_runs(ks: list[int]) -> list[int]:
    """Lengths of the runs of k == 0 between speculative rounds."""
    runs, n = [], 0
    for k in ks:
        if k == 0:
            n += 1
        elif n:
            runs.append(n)
            n = 0
    return runs


TWO_BUCKETS = [bucket(1, 4, [[1, 2], [2, 1]]), bucket(5, None, [[1, 1], [2, 1]])]
PHASE2 = {"enabled": True, "threshold": 0.3, "probe_base": 4, "probe_cap": 16, "probe_rounds": 1, "use_timing": False}


def test_plans_carry_ids_buckets_and_candidates():
    ctl = AdaptiveController(config(TWO_BUCKETS), 4, policy="ema")
    plans = [ctl.plan(b) for b in (1, 4, 5, 6, 100, 4, 0)]
    assert [p.plan_id for p in plans] == [0, 1, 2, 3, 4, 5, 6]
    # 5 is within the hysteresis of bucket 0 (1..4), 6 is not; 4 stays in bucket 1 (5..inf) for the same reason
    assert [p.bucket for p in plans] == [0, 0, 0, 1, 1, 1, 0]
    assert [(p.k, p.d, p.candidate) for p in plans[:4]] == [(1, 2, 0), (1, 2, 0), (1, 2, 0), (1, 1, 0)]
    assert not any(p.measure_depths for p in plans)
    assert all(p.measure_depths for p in [AdaptiveController(config(TWO_BUCKETS), 4, policy="goodput").plan(1)])


def test_disable_backoff_schedule_and_good_probe():
    ctl = AdaptiveController(config(TWO_BUCKETS, **PHASE2), 4, policy="ema")
    st = ctl.policy.states[0]
    ks = [run(ctl, 1, 0.0).k for _ in range(2)]  # E = 0 < 0.3 at the most conservative candidate -> off
    assert st.off
    ks += [run(ctl, 1, 0.0).k for _ in range(4 + 1 + 8 + 1 + 16 + 1 + 16)]  # plain runs and failing probes
    probe = run(ctl, 1, 1.0)  # a good probe
    assert (probe.k, probe.d, probe.candidate) == (1, 2, 0)
    ks.append(probe.k)
    assert plain_runs(ks) == [4, 8, 16, 16]  # base, 2·base, 4·base, capped
    assert not st.off and st.ema[0] == 1.0
    nxt = run(ctl, 1, 1.0)
    assert (nxt.k, nxt.candidate) == (1, 0)


def test_plain_plans_in_phase2_carry_bucket_and_no_candidate():
    ctl = AdaptiveController(config(TWO_BUCKETS, **PHASE2), 4, policy="ema")
    for _ in range(2):
        run(ctl, 1, 0.0)
    plan = run(ctl, 1, 0.0)
    assert (plan.k, plan.d, plan.bucket, plan.candidate) == (0, 0, 0, -1)


def test_bucket_change_keeps_off_state_and_backoff():
    ctl = AdaptiveController(config(TWO_BUCKETS, **PHASE2), 4, policy="ema")
    for _ in range(3):
        run(ctl, 1, 0.0)
    st = ctl.policy.states[0]
    assert st.off
    backoff, wait = st.backoff, st.wait_left
    assert run(ctl, 8, 1.0).bucket == 1
    back = run(ctl, 2, 1.0)  # re-entering bucket 0 is no evidence: it stays off, its backoff untouched
    assert (back.bucket, back.k) == (0, 0)
    assert st.off and st.backoff == backoff and st.wait_left == wait - 1


def test_batch_oscillating_at_a_bucket_edge_stays_off_after_switch_off():
    """Zero acceptance, batch 4,5,4,5,... across the 1..4 | 5.. edge: after the first switch-off only probes run."""

    def speculative_rounds(batches) -> int:
        ctl = AdaptiveController(config(TWO_BUCKETS, **{**PHASE2, "probe_cap": 64}), 4, policy="ema")
        ks = [run(ctl, b, 0.0).k for b in batches]
        assert ks.index(0) <= 4  # the first switch-off comes after min_samples rounds (per bucket visited)
        return sum(1 for k in ks if k > 0)

    steady = speculative_rounds([4] * 4000)
    assert steady <= 2 + 4000 // 64 + 5  # the switch-off rounds, then one probe per backoff (4, 8, ..., 64)
    for edge in ([4, 5], [5, 4], [4, 6]):  # hovering at the edge: one bucket, its backoff never reset
        assert speculative_rounds(edge * 2000) <= steady + 2, edge
    assert speculative_rounds([3, 7] * 2000) <= 2 * steady + 4  # really alternating: two buckets, each backs off
    ctl = AdaptiveController(config(TWO_BUCKETS), 4, policy="ema")
    assert len({ctl.plan(b).bucket for b in (4, 5) * 20}) == 1  # plans never flip buckets at the edge


def test_list_plain_candidate_route():
    buckets = [bucket(1, None, [[0, 0], [1, 2], [2, 1]], initial_index=1, theta_down=0.4)]
    ctl = AdaptiveController(config(buckets, enabled=False, probe_base=3, probe_cap=6, probe_rounds=2), 4, policy="ema")
    plans = [run(ctl, 1, 0.0) for _ in range(2)]  # E = 0 < theta_down -> down onto K=0
    plans += [run(ctl, 1, 0.0) for _ in range(3 + 2 + 6)]  # wait 3, failed 2-round probe, wait 6
    plans += [run(ctl, 1, 1.0) for _ in range(2)]  # good 2-round probe
    assert [(p.k, p.candidate) for p in plans[2:5]] == [(0, 0)] * 3
    assert [(p.k, p.candidate) for p in plans[5:7]] == [(1, 1)] * 2
    assert plain_runs([p.k for p in plans]) == [3, 6]
    assert run(ctl, 1, 1.0).candidate == 1


def test_preset_initial_plain_is_kept_on_bucket_change_but_probed():
    buckets = [bucket(1, 4, [[0, 0], [1, 2]], initial_index=0), bucket(5, None, [[1, 1]])]
    ctl = AdaptiveController(config(buckets, enabled=False, probe_base=3), 4, policy="ema")
    assert run(ctl, 1, 0.0).k == 0
    run(ctl, 8, 0.0)
    ks = [run(ctl, 1, 0.0).k for _ in range(3)]
    assert ks == [0, 0, 1]  # not switched on by the bucket change; probed after probe_base plain rounds


def test_timing_decides_probe_and_switches_off(monkeypatch):
    monkeypatch.setattr("looped_spec.control.policy.TIMING_WARMUP", 0)  # the rule itself, without warm-up
    ctl = AdaptiveController(config(TWO_BUCKETS, **{**PHASE2, "probe_base": 2, "use_timing": True}), 4, policy="ema")
    st = ctl.policy.states[0]
    for _ in range(2):
        run(ctl, 1, 0.0, 1.0)
    assert st.off
    run(ctl, 1, 0.0, 1.0)
    run(ctl, 1, 0.0, 1.0)  # plain rounds: 1 token/s per request
    assert st.plain_rate == {1: 1.0}
    run(ctl, 1, 1.0, 4.0)  # probe accepts everything but makes 2 tokens in 4 s: slower -> still off
    assert st.off and st.backoff == 4
    for _ in range(4):
        run(ctl, 1, 0.0, 1.0)
    run(ctl, 1, 1.0, 1.0)  # 2 tokens/s: on
    assert not st.off
    run(ctl, 1, 1.0, 4.0)
    run(ctl, 1, 1.0, 4.0)  # high acceptance, but slower than plain: off again
    assert st.off
    assert "slower than plain" in st.history[-1]


def test_fixed_and_off_controllers():
    fixed = FixedController(2, 1)
    plans = [fixed.plan(3) for _ in range(3)]
    assert [(p.plan_id, p.k, p.d, p.bucket, p.candidate) for p in plans] == [(i, 2, 1, -1, -1) for i in range(3)]
    fixed.observe(RoundFeedback(0, 2, 1, -1, -1, 3, [2] * 3, [1] * 3))
    assert fixed.stats()["observed"] == 1
    off = OffController()
    assert [(p.plan_id, p.k, p.d) for p in (off.plan(1), off.plan(9))] == [(0, 0, 0), (1, 0, 0)]
    with pytest.raises(ValueError):
        FixedController(1, 0)
    with pytest.raises(ValueError):
        FixedController(1, 4, full_depth=4)


def test_bad_policy_name():
    with pytest.raises(ValueError, match="policy"):
        AdaptiveController(config(TWO_BUCKETS), 4, policy="greedy")


def test_trace_jsonl(tmp_path: Path):
    path = tmp_path / "trace" / "ctl.jsonl"
    ctl = AdaptiveController(config(TWO_BUCKETS, **PHASE2), 4, policy="ema", trace_path=path)
    for _ in range(4):
        run(ctl, 1, 0.0)
    ctl.close()
    ctl.close()
    events = [json.loads(line) for line in path.read_text().splitlines()]
    kinds = [e["event"] for e in events]
    assert kinds.count("plan") == 4 and kinds.count("feedback") == 4
    decisions = [e for e in events if e["event"] == "decision"]
    assert decisions and decisions[0]["what"].startswith("off") and decisions[0]["bucket"] == 0
    assert [e["plan_id"] for e in events if e["event"] == "plan"] == [0, 1, 2, 3]
    plan = next(e for e in events if e["event"] == "plan")
    assert set(plan) == {"event", "t", "batch", "context"} | {f.name for f in fields(SpeculationPlan)}
    assert plan["context"] is None  # run() gives no context
    feedback = next(e for e in events if e["event"] == "feedback")
    assert set(feedback) == {"event", "t"} | {f.name for f in fields(RoundFeedback)}
    assert feedback["batch_size"] == 1 and feedback["num_proposed"] == [feedback["k"]]


def test_stats_count_calls_and_their_time():
    """The per-call cost itself is measured by benchmarks/bench_controller.py."""
    ctl = AdaptiveController(config(TWO_BUCKETS), 4, policy="ema")
    for batch in (1, 2, 6, 6, 1):
        run(ctl, batch, 0.5)
    stats = ctl.stats()
    assert stats["plans"] == stats["observed"] == 5 and stats["overhead_seconds"] > 0.0
    assert [b["batch"] for b in stats["buckets"]] == ["1..4", "5..inf"]


def test_lost_probe_feedback_does_not_stall():
    ctl = AdaptiveController(config(TWO_BUCKETS, **{**PHASE2, "probe_base": 2}), 4, policy="ema")
    for _ in range(4):
        run(ctl, 1, 0.0)  # off after 2, then the 2 plain rounds of the backoff
    probe = ctl.plan(1)  # the engine drops this round: no feedback ever comes
    assert probe.k == 1
    ks = [run(ctl, 1, 0.0).k for _ in range(3)]
    assert ks == [0, 0, 1]  # two plans later the empty probe is given up and repeated


def test_round_without_drafts_counts_as_plain(monkeypatch):
    monkeypatch.setattr("looped_spec.control.policy.TIMING_WARMUP", 0)
    ctl = AdaptiveController(config(TWO_BUCKETS, **PHASE2), 4, policy="ema")
    plan = ctl.plan(2)
    ctl.observe(RoundFeedback(plan.plan_id, plan.k, plan.d, 0, plan.candidate, 2, [0, 0], [0, 0], 0.0, 0.5))
    st = ctl.policy.states[0]
    assert st.samples == [0, 0] and st.rate == [{}, {}] and st.plain_rate == {2: 2.0}


def test_first_timed_rounds_are_warm_up():
    """Cold-start rounds (lazy set-up, capture) are not timed, so they cannot switch a good candidate off."""
    from looped_spec.control.policy import TIMING_WARMUP

    ctl = AdaptiveController(config(TWO_BUCKETS, **PHASE2), 4, policy="ema")
    st = ctl.policy.states[0]
    for i in range(TIMING_WARMUP + 1):
        plan = ctl.plan(2)
        ctl.observe(RoundFeedback(plan.plan_id, plan.k, plan.d, 0, plan.candidate, 2, [0, 0], [0, 0], 0.0, 0.5))
        assert st.plain_rate.get(2) == (None if i < TIMING_WARMUP else 2.0)
