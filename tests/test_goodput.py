"""Goodput policy: formulas, cost-model fit, acceptance estimates, and convergence on a simulated workload."""

from __future__ import annotations

import random

import pytest

from looped_spec.control import AdaptiveController, AdaptiveSpecConfig
from looped_spec.control.costmodel import LinearFit2, RoundCostModel
from looped_spec.control.goodput import DepthAcceptance, expected_accept_rate, expected_tokens
from looped_spec.control.measurement import MeasureSchedule
from looped_spec.control.plan import RoundFeedback
from looped_spec.control.simulate import SyntheticWorkload

CANDIDATES = [[0, 0], [1, 2], [4, 1], [6, 1]]
ALPHA = [0.7, 0.88, 0.96, 1.0]
COSTS = {"draft_step": (1e-3, 1e-5), "verify_step": (1e-3, 3e-5), "commit": (1e-4, 1e-6)}


def sim_config() -> AdaptiveSpecConfig:
    def bucket(lo, hi):
        return {"min_batch": lo, "max_batch": hi, "candidates": CANDIDATES, "initial_index": 1}

    knobs = {"theta_up": 0.8, "theta_down": 0.4, "interval": 4, "min_samples": 4}
    buckets = [{**bucket(lo, hi), **knobs} for lo, hi in [(1, 2), (3, 16), (17, None)]]
    return AdaptiveSpecConfig.parse({"model": "sim", "full_depth": 4, "buckets": buckets, "provenance": "test"})


def test_expected_tokens_formula():
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)  # (1 - 0.5^3) / 0.5
    assert expected_tokens(1.0, 3) == 4.0
    assert expected_tokens(0.3, 0) == 1.0
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_accept_rate(0.5, 2) == pytest.approx(0.375)  # (0.5 + 0.25) / 2


def test_linear_fit_recovers_parameters_and_stays_nonnegative():
    fit = LinearFit2(decay=1.0)
    for x0, x1 in [(1, 1), (2, 8), (3, 3), (4, 32)]:
        fit.add(x0, x1, 0.5 * x0 + 0.25 * x1)
    assert fit.params() == pytest.approx((0.5, 0.25))
    neg = LinearFit2(decay=1.0)
    for x0, x1 in [(1, 1), (1, 2), (1, 3)]:
        neg.add(x0, x1, 3.0 - 0.5 * x1)  # the unconstrained slope would be negative
    p0, p1 = neg.params()
    assert p0 >= 0.0 and p1 >= 0.0


def test_cost_model_recovers_the_simulated_costs():
    sim = SyntheticWorkload(4, ALPHA, noise=0.0, **COSTS)
    model = RoundCostModel(4, decay=1.0)
    assert model.predict(2, 1, 8) == 1 * (2 + 1) + (4 - 1)  # untimed: loop steps d(K+1) + (D - d)
    for k, d, b in [(0, 0, 1), (0, 0, 8), (1, 2, 1), (4, 1, 8), (6, 1, 3), (1, 3, 16)]:
        model.observe(k, d, b, *sim.phase_times(k, d, b))
    for k, d, b in [(0, 0, 32), (2, 2, 5), (4, 1, 1), (6, 1, 20)]:
        assert model.predict(k, d, b) == pytest.approx(sum(sim.phase_times(k, d, b)), rel=1e-5)


def test_depth_acceptance_from_counterfactuals_and_geometric_counts():
    acc = DepthAcceptance(4, memory=1e9)
    acc.observe(RoundFeedback(0, 0, 0, 0, 0, 2, [0, 0], [0, 0], depth_matches=[1, 2, 3, 4], depth_trials=[4] * 4))
    assert [acc.alpha(d) for d in (1, 2, 3, 4)] == [0.25, 0.5, 0.75, 1.0]
    geo = DepthAcceptance(4, memory=1e9)
    # requests accepted 3 of 3 (no rejection), 1 of 3 (rejected at the 2nd), 0 of 3 -> 4 successes in 6 trials
    geo.observe(RoundFeedback(0, 3, 2, 0, 0, 3, [3, 3, 3], [3, 1, 0]))
    assert geo.alpha(2) == pytest.approx(4 / 6) and geo.alpha(1) is None
    rng = random.Random(0)
    big = DepthAcceptance(4)
    for _ in range(400):
        n = 20
        matches = [sum(rng.random() < 0.6 for _ in range(n))] * 4
        big.observe(RoundFeedback(0, 0, 0, 0, 0, n, [0] * n, [0] * n, depth_matches=matches, depth_trials=[n] * 4))
    assert big.alpha(1) == pytest.approx(0.6, abs=0.05)


def test_explores_every_option_first():
    ctl = AdaptiveController(sim_config(), 4, policy="goodput")  # explores each option twice
    sim = SyntheticWorkload(4, ALPHA, seed=1, **COSTS)
    seen = []
    for _ in range(8):
        plan = ctl.plan(1)
        seen.append((plan.k, plan.d, plan.candidate))
        ctl.observe(sim.feedback(plan, 1))
    assert seen == [(k, d, i) for i, (k, d) in enumerate(CANDIDATES)] * 2


def simulate(policy: str, phases, seed: int = 7, timed: bool = True):
    ctl = AdaptiveController(sim_config(), 4, policy=policy)
    ctl.measure = MeasureSchedule(every=1)  # learn acceptance every round
    sim = SyntheticWorkload(4, ALPHA, seed=seed, timed=timed, **COSTS)
    options = [tuple(c) for c in CANDIDATES]
    report = []
    for batch, rounds in phases:
        chosen = []
        for _ in range(rounds):
            plan = ctl.plan(batch)
            ctl.observe(sim.feedback(plan, batch))
            chosen.append((plan.k, plan.d))
        best = options[sim.best(options, batch)]
        bucket = ctl.stats()["buckets"][ctl.bucket_for(batch)]
        tail = chosen[-100:]
        report.append((batch, best, (bucket["k"], bucket["d"]), sum(c == best for c in tail) / len(tail)))
    return ctl, report


def test_goodput_converges_and_follows_the_batch_size():
    sim = SyntheticWorkload(4, ALPHA, **COSTS)
    options = [tuple(c) for c in CANDIDATES]
    bests = {b: options[sim.best(options, b)] for b in (1, 8, 32)}
    assert len(set(bests.values())) == 3  # the workload makes every bucket's best different ...
    for b, best in bests.items():  # ... by a clear margin (>= 5 %)
        rates = sorted((sim.goodput(k, d, b) for k, d in options), reverse=True)
        assert rates[0] >= 1.05 * rates[1], (b, best)
    _, report = simulate("goodput", [(1, 300), (8, 300), (32, 300), (8, 150), (1, 150)])
    for batch, best, final, share in report:
        assert final == best, (batch, report)
        assert share >= 0.9, (batch, report)


def test_goodput_without_timings_still_decides_from_acceptance():
    _, report = simulate("goodput", [(1, 200)], timed=False)
    # untimed, a round costs loop steps d(K+1) + (D - d) (plain: D). Per step at alpha_1 = 0.7, alpha_2 = 0.88:
    # plain 1/4 = 0.25, (1, 2): 1.88/6 = 0.31, (4, 1): 2.77/8 = 0.35, (6, 1): 3.06/10 = 0.31
    assert report[0][2] == (4, 1)


def reexplored_rounds(alpha: list[float], rounds: int = 8000) -> tuple[AdaptiveController, list[tuple[int, int, int]]]:
    """(controller, [(round, k, d)] of the speculative rounds after the first exploration) at B = 8."""
    ctl = AdaptiveController(sim_config(), 4, policy="goodput")
    sim = SyntheticWorkload(4, alpha, seed=3, **COSTS)
    speculative = []
    for r in range(rounds):
        plan = ctl.plan(8)
        ctl.observe(sim.feedback(plan, 8))
        if plan.k > 0 and r >= 100:
            speculative.append((r, plan.k, plan.d))
    return ctl, speculative


def test_reexploration_backs_off_while_it_changes_nothing():
    """Without a cost profile each bucket re-runs its other options every `reexplore_every` rounds to keep their
    costs current. Where nothing beats plain the re-runs change nothing, and the gap doubles each time (up to
    REEXPLORE_BACKOFF times): over 8000 rounds 5 re-explorations instead of 31. Only options predicted within
    REEXPLORE_WITHIN of the best are re-run: at α₂ = 0.5 (1, 2) commits 1.5 tokens a round for ~1.7x plain's
    cost (~0.9x plain), (4, 1) and (6, 1) at α₁ = 0 one token for 2-2.5x (≤ 0.5x plain)."""
    from looped_spec.control.goodput import REEXPLORE_BACKOFF, REEXPLORE_WITHIN

    ctl, speculative = reexplored_rounds([0.0, 0.5, 0.0, 1.0])
    policy = ctl.policy
    st = policy.states[ctl.bucket_for(8)]
    assert st.options[st.current][0] == 0  # plain
    plain = st.predicted[st.plain]
    near = [st.options[o][:2] for o, rate in enumerate(st.predicted) if rate >= REEXPLORE_WITHIN * plain]
    assert sorted(near) == [(0, 0), (1, 2)]
    assert {(k, d) for _, k, d in speculative} == {(1, 2)}  # the options far below plain are not re-run
    base = policy.reexplore_every
    late = [r for r, _, _ in speculative]
    starts = [r for i, r in enumerate(late) if i == 0 or r - late[i - 1] > 1]
    # re-explorations start when the gap since the previous one has passed: 256, then gaps of 256, 512, 1024, 2048
    assert [round(r / base) * base for r in starts] == [base, 2 * base, 4 * base, 8 * base, 16 * base]
    assert st.reexplore_gap == REEXPLORE_BACKOFF * base  # capped at 16 x 256


def test_reexploration_skips_options_that_cannot_pay():
    """At zero acceptance every speculative option commits one token a round for more than a plain round costs:
    after the first exploration no round speculates (the random-weight fixture re-ran three such plans every
    256-4096 rounds)."""
    ctl, speculative = reexplored_rounds([0.0, 0.0, 0.0, 1.0])
    assert speculative == []
    st = ctl.policy.states[ctl.bucket_for(8)]
    assert st.options[st.current][0] == 0 and st.reexplore_gap > ctl.policy.reexplore_every  # still backing off


def test_goodput_learns_each_plans_own_committed_tokens():
    """E of the plan that runs comes from its rounds (Markov expectation as a 32-round prior) once it has run
    REALIZED_MIN full-K request-rounds (fewer are a few neighbouring positions of one text); requests cut below
    K near their end and early-exit rounds are left out; every plan's tokens fade with the positions committed
    since (REALIZED_MEMORY, any plan's); a plan that commits less than predicted is left."""
    from test_acceptance_cost import profiled_config

    from looped_spec.control.acceptance import markov_tokens
    from looped_spec.control.realized import REALIZED_MEMORY, REALIZED_MIN, REALIZED_PRIOR

    ctl = AdaptiveController(profiled_config([0.9, 0.95, 0.99, 1.0]), 4)
    policy = ctl.policy
    first = ctl.plan(1)
    k, d = first.k, first.d
    assert k > 0
    chain = markov_tokens(0.9 if d == 1 else 0.95, 0.0, k)
    assert policy.tokens(k, d) == pytest.approx(chain)  # nothing ran: the chain as it is
    fb = RoundFeedback(first.plan_id, k, d, first.bucket, first.candidate, 3, [k, k, k - 1], [k, 0, 0])
    ctl.observe(fb)  # full-K requests commit k + 1 and 1 token; the third drafted k - 1: not counted
    assert policy.realized_of(k, d) == pytest.approx((k + 2, 2))

    def expected() -> float:  # the chain with the depth's error on accepted tokens (tested on its own below)
        return 1.0 + (chain - 1.0) * policy.realized.error(d)

    assert policy.realized.error(d) < 1.0
    assert policy.tokens(k, d) == pytest.approx(expected())  # 2 request-rounds: not yet evidence
    tokens, rounds = float(k + 2), 2.0
    while rounds < REALIZED_MIN:  # rounds of 4 requests, each committing one token
        ctl.observe(RoundFeedback(first.plan_id, k, d, first.bucket, first.candidate, 4, [k] * 4, [0] * 4))
        keep = REALIZED_MEMORY / (REALIZED_MEMORY + 4)
        tokens, rounds = keep * tokens + 4, keep * rounds + 4
    assert policy.realized_of(k, d) == pytest.approx((tokens, rounds))
    assert policy.tokens(k, d) == pytest.approx((expected() * REALIZED_PRIOR + tokens) / (REALIZED_PRIOR + rounds))
    before = policy.realized_of(k, d)
    ctl.observe(RoundFeedback(1, k, d, 0, first.candidate, 1, [k], [0], exit_depths=[4]))  # early exit: ExitDepths'
    fade = REALIZED_MEMORY / (REALIZED_MEMORY + 1)  # ... but its committed token is text the memory moves past
    assert policy.realized_of(k, d) == pytest.approx([fade * x for x in before])
    before = policy.realized_of(k, d)
    ctl.observe(RoundFeedback(2, 0, 0, 0, -1, 8, [0] * 8, [0] * 8))  # plain rounds: every plan's tokens fade too
    fade = REALIZED_MEMORY / (REALIZED_MEMORY + 8)
    assert policy.realized_of(k, d) == pytest.approx([fade * x for x in before])
    # the plan keeps rejecting its first draft (one token per round; no readouts, so α_d does not move):
    # only its own rounds can tell, and they make the policy leave it
    for _ in range(200):
        plan = ctl.plan(1)
        if (plan.k, plan.d) != (k, d):
            break
        ctl.observe(RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, 1, [plan.k], [0]))
    assert (plan.k, plan.d) != (k, d)
    assert policy.tokens(k, d) < 0.9 * chain  # left as soon as another plan was predicted 3 % better


def test_goodput_measures_every_round_while_its_acceptance_is_young():
    """For its first YOUNG_ROUNDS rounds, or until YOUNG_POSITIONS positions were read out if sooner, the
    controller asks for readouts at the young budget (every round while their cost is unknown); then at the
    schedule's normal interval."""
    from test_acceptance_cost import profiled_config

    from looped_spec.control.goodput import YOUNG_POSITIONS, YOUNG_ROUNDS

    def rounds_young(positions_per_round: int) -> int:
        ctl = AdaptiveController(profiled_config([0.9, 0.95, 0.99, 1.0]), 4)
        rounds = 0
        while ctl.policy.acceptance_young:
            plan = ctl.plan(4)
            assert plan.measure_depths
            n = positions_per_round
            ctl.observe(
                RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, 4, [plan.k] * 4,
                              [plan.k] * 4, depth_matches=[n] * 4, depth_trials=[n] * 4)
            )  # fmt: skip
            rounds += 1
        measured = sum(ctl.plan(4).measure_depths for _ in range(400))
        assert 400 / 12 < measured < 400 / 4  # then initial_every = 8, jittered
        return rounds

    assert rounds_young(1) == YOUNG_ROUNDS  # few positions per round: the round limit ends it
    assert rounds_young(32) == YOUNG_POSITIONS // 32  # many: the positions do


def test_goodput_redecides_when_the_batch_moves_by_an_eighth():
    """Between its periodic decisions a bucket decides again once the batch size has moved by an eighth of the
    last decided size (at least one request), not on every request a static batch's tail loses."""
    from test_acceptance_cost import profiled_config

    ctl = AdaptiveController(profiled_config([0.9, 0.95, 0.99, 1.0]), 4)
    policy = ctl.policy
    ctl.plan(32)
    state = policy.states[ctl.bucket_for(32)]
    assert state.decided_batch == 32
    ctl.plan(31)
    ctl.plan(29)
    assert state.decided_batch == 32  # 3 < 32 // 8
    ctl.plan(28)
    assert state.decided_batch == 28
    small = AdaptiveController(profiled_config([0.9, 0.95, 0.99, 1.0]), 4)
    small.plan(3)
    small.plan(2)
    assert small.policy.states[small.bucket_for(2)].decided_batch == 2  # a single request is an eighth of 3


def test_goodput_decides_once_enough_text_was_committed_since_its_last_decision():
    """After the young phase a periodic decision also waits for DECISION_POSITIONS committed positions: a single
    plain stream commits one per round, so it re-decides every 32 rounds, not every 8; a batch of 8 every 8."""
    from test_acceptance_cost import profiled_config

    from looped_spec.control.goodput import DECISION_POSITIONS, MIN_DECISION_GAP, YOUNG_ROUNDS

    def decision_rounds(batch: int, rounds: int) -> list[int]:
        ctl = AdaptiveController(profiled_config([0.05, 0.1, 0.15, 1.0]), 4)  # plain, no trials: nothing pays
        policy = ctl.policy
        decided = []
        decide = policy._decide
        policy._decide = lambda st, b, context=None, remaining=None: (decided.append(policy.rounds_seen),
                                                                       decide(st, b, context, remaining))  # fmt: skip
        for _ in range(rounds):
            plan = ctl.plan(batch)  # every request commits one token a round, whatever the plan
            k = [plan.k] * batch
            ctl.observe(RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, batch, k, [0] * batch))
        return [r for r in decided if r >= YOUNG_ROUNDS]

    single = decision_rounds(1, YOUNG_ROUNDS + 200)
    assert single and {b - a for a, b in zip(single, single[1:])} == {DECISION_POSITIONS}
    eight = decision_rounds(8, YOUNG_ROUNDS + 80)
    assert eight and {b - a for a, b in zip(eight, eight[1:])} == {MIN_DECISION_GAP}


def test_realized_tokens_survive_the_fade_underflowing():
    """Every plan's realized tokens fade by one shared scale per round; before that scale underflows it is folded
    into the stored values, so a plan's counts stay exact over any number of rounds."""
    from test_acceptance_cost import profiled_config

    from looped_spec.control.realized import REALIZED_MEMORY

    ctl = AdaptiveController(profiled_config([0.9, 0.95, 0.99, 1.0]), 4)
    policy = ctl.policy
    policy.observe(RoundFeedback(0, 2, 1, 0, 1, 1, [2], [2]))  # (2, 1): 3 tokens in one request-round
    heavy = RoundFeedback(1, 0, 0, 0, 0, 64, [0] * 64, [5] * 64)  # 384 positions: the scale halves each round
    for _ in range(400):  # 0.51 ** 400 ~ 1e-117: past the fold at 1e-100
        policy.observe(heavy)
    policy.observe(RoundFeedback(2, 2, 1, 0, 1, 2, [2, 2], [1, 0]))  # 2 + 1 tokens in two request-rounds
    assert policy.realized_of(2, 1) == pytest.approx((3.0, 2.0), rel=1e-9)  # the old round faded to ~1e-117
    plans = policy.realized.plans
    assert plans.scale > 1e-100 and all(v < 1e120 for pair in plans.sums.values() for v in pair)
    policy.observe(RoundFeedback(3, 0, 0, 0, 0, 1, [0], [0]))
    fade = REALIZED_MEMORY / (REALIZED_MEMORY + 1)
    assert policy.realized_of(2, 1) == pytest.approx((3.0 * fade, 2.0 * fade), rel=1e-9)


@pytest.mark.parametrize("round_seconds, gap", [(0.1, 8), (0.01, 20), (0.001, 64)])
def test_goodput_spaces_decisions_so_they_cost_half_a_percent_of_the_rounds(monkeypatch, round_seconds, gap):
    """A decision timed at 1 ms (a fake clock) in a bucket whose rounds take `round_seconds`: the next one comes
    after max(MIN_DECISION_GAP, 1 ms ÷ (DECISION_BUDGET · round)) rounds, at most MAX_DECISION_GAP."""
    from test_acceptance_cost import profiled_config

    import looped_spec.control.goodput as goodput

    assert (goodput.DECISION_BUDGET, goodput.MIN_DECISION_GAP, goodput.MAX_DECISION_GAP) == (0.005, 8, 64)
    clock = iter(range(10**6))
    monkeypatch.setattr(goodput, "perf_counter", lambda: next(clock) * 1e-3)  # every call: 1 ms later
    ctl = AdaptiveController(profiled_config([0.05, 0.05, 0.05, 1.0]), 4)  # plain, nothing near: no trials
    policy = ctl.policy
    decided = []
    decide = policy._decide
    policy._decide = lambda st, b, context=None, remaining=None: (decided.append(st.rounds),
                                                                   decide(st, b, context, remaining))  # fmt: skip
    for _ in range(goodput.YOUNG_ROUNDS + 3 * gap + 1):  # eight requests: 8 positions a round
        plan = ctl.plan(8)
        k = [plan.k] * 8
        ctl.observe(RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, 8, k, [0] * 8,
                                  full_depth_time=round_seconds))  # fmt: skip
    late = [r for r in decided if r > goodput.YOUNG_ROUNDS]
    assert len(late) >= 2 and {b - a for a, b in zip(late, late[1:])} == {gap}


def test_a_shrinking_batch_redecides_only_once_the_last_decision_is_paid_for(monkeypatch):
    """A static batch loses a request every few rounds in its tail; each loss of an eighth asks for a decision,
    but not before the last one cost at most DECISION_BUDGET of the rounds since (1 ms decisions, 10 ms rounds:
    every 20th round), so the tail does not re-price every option's drain at each request that finishes."""
    from test_acceptance_cost import profiled_config

    import looped_spec.control.goodput as goodput

    clock = iter(range(10**6))
    monkeypatch.setattr(goodput, "perf_counter", lambda: next(clock) * 1e-3)  # every call: 1 ms later
    ctl = AdaptiveController(profiled_config([0.05, 0.05, 0.05, 1.0]), 4)
    policy = ctl.policy
    decided = []
    decide = policy._decide
    policy._decide = lambda st, b, context=None, remaining=None: (decided.append((st.rounds, b)),
                                                                   decide(st, b, context, remaining))  # fmt: skip
    for batch in [8] * 30 + [7, 6, 5, 4] * 6:  # one request fewer every round, then again (within a bucket)
        plan = ctl.plan(batch)
        k = [plan.k] * batch
        ctl.observe(RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, batch, k, [0] * batch,
                                  full_depth_time=0.01))  # fmt: skip
    tail = [r for r, _ in decided if r > 30]
    assert tail and all(b - a >= 20 for a, b in zip([r for r, _ in decided], [r for r, _ in decided][1:]) if b > 30)
    assert len(tail) <= 24 // 20 + 1


def measured_plain_rounds(alpha: list[float], rounds: int = 2000) -> tuple[AdaptiveController, int, int]:
    """A profiled controller at B = 4 with acceptance `alpha` (all depths read out); measured rounds cost 5 %
    more than unmeasured ones. Returns it, its plain rounds and its measured plain rounds after the young phase."""
    from test_acceptance_cost import profiled_config

    ctl = AdaptiveController(profiled_config(alpha), 4)
    plain = measured = 0
    for _ in range(rounds):
        plan = ctl.plan(4)
        seconds = 1.05 if plan.measure_depths else 1.0
        trials = [4] * 4 if plan.measure_depths else []
        matches = [round(4 * a) for a in alpha] if plan.measure_depths else []
        ctl.observe(
            RoundFeedback(plan.plan_id, plan.k, plan.d, plan.bucket, plan.candidate, 4, [plan.k] * 4, [plan.k] * 4,
                          full_depth_time=seconds, depth_matches=matches, depth_trials=trials)
        )  # fmt: skip
        if plan.k == 0 and not ctl.policy.acceptance_young:
            plain += 1
            measured += plan.measure_depths
    return ctl, plain, measured


def test_plain_rounds_take_fewer_readouts_when_no_plan_is_near_a_switch():
    """With acceptance so low that every speculative option is predicted under plain decoding, plain rounds
    are measured at the far budget (every ~20th round for a 5 % readout cost, against every ~5th); with one near
    plain they are measured at the normal budget (control/measurement.py, GoodputPolicy.readouts_far)."""
    from looped_spec.control.goodput import READOUTS_FAR_FROM

    ctl, plain, measured = measured_plain_rounds([0.05, 0.1, 0.2, 1.0])
    policy = ctl.policy
    st = policy.states[0]
    rates = st.predicted
    assert st.options[st.current][0] == 0 and policy.readouts_far(0)
    assert max(r for o, r in zip(st.options, rates) if o[0] > 0) < READOUTS_FAR_FROM * rates[st.plain]
    assert ctl.measure.every(False) == 5 and ctl.measure.every(False, far=True) == 20
    assert plain > 1500 and plain / 26 < measured < plain / 15
    near, _, _ = measured_plain_rounds([0.6, 0.8, 0.9, 1.0], rounds=400)
    st = near.policy.states[0]
    assert not near.policy.readouts_far(0)
    assert st.options[st.current][0] > 0 or max(st.predicted[o] for o in range(len(st.options)) if o != st.plain) >= (
        READOUTS_FAR_FROM * st.predicted[st.plain]
    )


def test_readouts_go_far_once_no_option_is_predicted_over_plain(monkeypatch):
    """The far budget needs every speculative option under plain decoding's price (READOUTS_FAR_FROM = 1.0): an
    option 3 % under plain is not within the margin it would need to run; one 1 % over plain keeps the 1 % budget."""
    ctl, _, _ = measured_plain_rounds([0.05, 0.1, 0.2, 1.0])
    policy = ctl.policy
    st = policy.states[0]
    first = next(i for i, o in enumerate(st.options) if o[0] > 0)
    for top, far in ((0.97, True), (1.01, False), (0.97, True)):
        rates = [100.0 if o[0] == 0 else 50.0 for o in st.options]
        rates[first] = 100.0 * top
        monkeypatch.setattr(policy, "rates", lambda *args, rates=rates, **kwargs: list(rates))
        policy._decide(st, 1)
        assert st.options[st.current][0] == 0 and policy.readouts_far(0) is far
