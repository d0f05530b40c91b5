"""The pass-cost model (control/passcost.py) against by-hand sums of the parts its docstring lists.

Every expected price here is written out term by term in plain Python (steps, passes with the context one token
longer per draft step, readouts, outside terms), never through the module's own feature functions; the measured
rounds' extra readouts are also counted on a real engine's runner.
"""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from conftest import load

from looped_spec.control.exits import ExitDepths
from looped_spec.control.passcost import PassCost, width_weights
from looped_spec.presets.lookup import read_preset_file, shipped_preset_path
from looped_spec.presets.schema import CostConfig
from looped_spec.tuning.derive import ideal_cost

D = 4
# distinct values everywhere, so two swapped coefficients cannot price alike
COST = {
    "positions": [1, 4, 16],
    "pass_seconds": [1.0, 1.6, 3.1],
    "request_seconds": 0.05,  # g
    "request_context_seconds": 0.001,  # h
    "query_context_seconds": 0.0002,  # a
    "step_seconds": [0.3, 0.02, 0.01],  # s0, s_r, s_n
    "embed_seconds": [0.07, 0.005],  # e0, e_n
    "readout_seconds": [0.2, 0.03],  # ro0, ro_n
    "round_seconds": [0.4, 0.006],  # o0, o_B
    "speculative_seconds": [0.11, 0.013, 0.0017],  # v0, v_K, v_n
}


def config(**changes) -> CostConfig:
    return CostConfig.model_validate({**COST, **changes})


def w_by_hand(n: float) -> float:
    """The pass curve of COST: (1, 1.0), (4, 1.6), (16, 3.1), flat before 1, the last segment extended."""
    if n <= 1:
        return 1.0
    if n <= 4:
        return 1.0 + (n - 1) * (1.6 - 1.0) / (4 - 1)
    return 1.6 + (n - 4) * (3.1 - 1.6) / (16 - 4)


def one_pass(requests: float, positions: float, context: float) -> float:
    g, h, a = COST["request_seconds"], COST["request_context_seconds"], COST["query_context_seconds"]
    return w_by_hand(positions) + g * requests + h * requests * context + a * positions * context


def step(requests: float, positions: float, embeds: bool) -> float:
    s0, s_r, s_n = COST["step_seconds"]
    e0, e_n = COST["embed_seconds"]
    return s0 + s_r * requests + s_n * positions + ((e0 + e_n * positions) if embeds else 0.0)


def readout(positions: float) -> float:
    ro0, ro_n = COST["readout_seconds"]
    return ro0 + ro_n * positions


def by_hand(k: int, d: int, b: int, context: float, depth: int = D) -> float:
    o0, o_b = COST["round_seconds"]
    v0, v_k, v_n = COST["speculative_seconds"]
    if k == 0:  # one step over B positions with D passes, a readout
        total = step(b, b, True) + depth * one_pass(b, b, context) + readout(b)
        return total + o0 + o_b * b
    total = 0.0
    for j in range(k + 1):  # K+1 draft steps, d passes each, the context one token longer at every step
        total += step(b, b, True) + sum(one_pass(b, b, context + j) for _ in range(d))
    total += k * readout(b)  # a readout after all draft steps but the last
    wide = b * (k + 1)  # the verify step: D - d passes over B(K+1) positions, a readout of all
    total += step(b, wide, False) + (depth - d) * one_pass(b, wide, context + k) + readout(wide)
    return total + o0 + o_b * b + v0 + v_k * (k + 1) + v_n * wide


@pytest.mark.parametrize(
    "k,d,b,context",
    [(0, 0, 1, 0.0), (0, 0, 3, 57.5), (0, 0, 40, 900.0), (1, 3, 2, 10.0), (3, 1, 5, 100.0), (4, 2, 20, 300.0)],
)
def test_a_round_costs_the_sum_of_its_parts(k, d, b, context):
    cost = PassCost(config(), D)
    assert cost.profile_seconds([k], [d], b, context)[0] == pytest.approx(by_hand(k, d, b, context), rel=1e-12)


def test_all_options_at_once_price_like_each_alone():
    cost = PassCost(config(), D)
    ks, ds = [0, 1, 3, 2, 5], [0, 1, 2, 3, 1]
    got = cost.profile_seconds(ks, ds, 6, 33.0)
    assert got == pytest.approx([by_hand(k, d, 6, 33.0) for k, d in zip(ks, ds)], rel=1e-12)


def test_width_is_linear_between_grid_points_and_extrapolated_past_the_last():
    # only the pass curve costs anything, and D = 1: a plain round is one pass, w(B)
    zero = {key: 0.0 for key in ("request_seconds", "request_context_seconds", "query_context_seconds")}
    cfg = config(
        positions=[4, 8, 32],
        pass_seconds=[2.0, 3.0, 5.0],
        step_seconds=[0.0, 0.0, 0.0],
        embed_seconds=[0.0, 0.0],
        readout_seconds=[0.0, 0.0],
        round_seconds=[0.0, 0.0],
        speculative_seconds=[0.0, 0.0, 0.0],
        **zero,
    )
    cost = PassCost(cfg, 1)
    expected = {
        1: 2.0,  # below the first point: the first point's value, never less
        3: 2.0,
        4: 2.0,
        6: 2.5,
        8: 3.0,
        20: 4.0,
        32: 5.0,
        64: 5.0 + (64 - 32) * (5.0 - 3.0) / (32 - 8),  # the last segment extended
    }
    for b, w in expected.items():
        assert cost.profile_seconds([0], [0], b, 0.0)[0] == pytest.approx(w, rel=1e-12), b
    # the weights are a partition of unity that reproduces any linear function at and past the first point
    grid = np.array([4.0, 8.0, 32.0])
    n = np.array([4.0, 5.5, 8.0, 17.0, 32.0, 100.0])
    weights = width_weights(grid, n)
    assert weights.sum(axis=1) == pytest.approx(np.ones(len(n)))
    assert weights @ (3.0 + 0.5 * grid) == pytest.approx(3.0 + 0.5 * n)


def test_lines_reproduce_the_profile_at_any_context():
    options = [(2, 1), (3, 2), (5, 1), (1, 3)]
    cost = PassCost(config(), D, options=options)
    assert cost.options == sorted(options + [(0, 0)])
    for batch in (1, 7, 33):
        intercept, slope = cost.lines(batch)
        for context in (0.0, 13.7, 2048.0, 1e4):
            for i, (k, d) in enumerate(cost.options):
                line = intercept[i] + slope[i] * context
                assert line == pytest.approx(by_hand(k, d, batch, context), rel=1e-9), (batch, context, k, d)
                assert cost.seconds(k, d, batch, context) == pytest.approx(line, rel=1e-12)


def test_a_plan_outside_the_options_is_priced_directly():
    cost = PassCost(config(), D, options=[(2, 1)])
    for k, d in [(3, 2), (1, 1), (6, 3)]:
        assert (k, d) not in cost.option_index
        assert cost.seconds(k, d, 5, 80.0) == pytest.approx(by_hand(k, d, 5, 80.0), rel=1e-9)
    assert cost.seconds(0, 3, 5, 80.0) == pytest.approx(by_hand(0, 0, 5, 80.0), rel=1e-9)  # K = 0 is plain


def test_lines_follow_the_exit_depths_when_their_version_moves():
    cost = PassCost(config(), D, options=[(2, 1), (3, 2)])
    exits = ExitDepths(D, memory=64.0)
    exits.observe([1, 1, 2, 4], skips=True)
    for batch in (1, 6):
        intercept, slope = np.asarray(cost.lines(batch, exits))
        want = cost.profile_seconds(*zip(*cost.options), batch, 50.0, exits.survival())
        assert intercept + slope * 50.0 == pytest.approx(want, rel=1e-9)
    version = exits.version
    while exits.version == version:
        exits.observe([4, 4, 4, 4], skips=True)  # the exits become rarer: every price rises
    intercept, slope = np.asarray(cost.lines(6, exits))
    want = cost.profile_seconds(*zip(*cost.options), 6, 50.0, exits.survival())
    assert intercept + slope * 50.0 == pytest.approx(want, rel=1e-9)
    cost.lines(3, None)
    # the prices of older exit depths are dropped (a long run under early exit moves the version for ever)
    assert sorted(cost._lines, key=str) == [(3, None), (6, exits.version)]


def test_every_token_exiting_at_loop_one_makes_a_plain_round_one_pass():
    deep, shallow = PassCost(config(), D), PassCost(config(), 1)
    first = np.array([1.0, 0.0, 0.0, 0.0])  # P(still looping at loop i+1): all exit after loop 1
    for b, context in [(1, 0.0), (5, 70.0), (40, 300.0)]:
        got = deep.profile_seconds([0], [0], b, context, first)[0]
        assert got == pytest.approx(shallow.profile_seconds([0], [0], b, context)[0], rel=1e-12)
        assert got == pytest.approx(by_hand(0, 0, b, context, depth=1), rel=1e-12)
        assert got < deep.profile_seconds([0], [0], b, context)[0]


def test_survival_all_ones_is_no_early_exit():
    cost = PassCost(config(), D)
    ks, ds = [0, 1, 3, 2], [0, 1, 2, 3]
    for b in (1, 4, 30):
        assert cost.profile_seconds(ks, ds, b, 64.0, np.ones(D)) == pytest.approx(
            cost.profile_seconds(ks, ds, b, 64.0), rel=1e-12
        )


def test_more_exits_never_cost_more():
    cost = PassCost(config(), D)
    ks, ds = [0, 1, 3, 2, 4], [0, 1, 2, 3, 1]
    rng = random.Random(3)
    for _ in range(60):
        b, context = rng.choice([1, 2, 5, 17, 64]), rng.uniform(0.0, 500.0)
        survival = np.minimum.accumulate([1.0] + [rng.random() for _ in range(D - 1)])
        fewer = np.minimum.accumulate(survival * np.array([1.0] + [rng.random() for _ in range(D - 1)]))
        more_exits = cost.profile_seconds(ks, ds, b, context, fewer)
        some = cost.profile_seconds(ks, ds, b, context, survival)
        none = cost.profile_seconds(ks, ds, b, context)
        assert np.all(more_exits <= some * (1 + 1e-12)), (survival, fewer)
        assert np.all(some <= none * (1 + 1e-12)), survival


def test_measured_rounds_read_out_the_other_depths():
    cost = PassCost(config(), D)
    b = 5
    assert cost.measure_seconds(0, 0, b) == pytest.approx((D - 1) * readout(b))
    # (K, d): the draft's depths 1..d-1 at its K+1 positions and depth d at the last (it drafts from K of them);
    # the verifier's depths d+1..D-1 at all B(K+1) positions
    for k, d, draft, verify in [(3, 2, 5, 1), (2, 3, 7, 0), (1, 1, 1, 2), (4, 1, 1, 2)]:
        want = draft * readout(b) + verify * readout(b * (k + 1))
        assert cost.measure_seconds(k, d, b) == pytest.approx(want, rel=1e-12), (k, d)
    # the drift factor scales them like every prediction, whether the plan is one of the priced options or not
    cost = PassCost(config(), D, drift_rounds=1.0, options=[(3, 2)])
    unscaled = {(k, d): cost.measure_seconds(k, d, b) for k, d in [(0, 0), (3, 2), (2, 3)]}
    cost.observe(1.7, 1.0)
    assert cost.drift == pytest.approx(math.exp(0.5))  # one round, the step clipped at 0.5 in log space
    for (k, d), seconds in unscaled.items():
        assert cost.measure_seconds(k, d, b) == pytest.approx(cost.drift * seconds, rel=1e-12), (k, d)


@pytest.mark.parametrize("read", [None, [1, 3], [2]])
@pytest.mark.parametrize("k,d", [(0, 0), (3, 1), (2, 2), (2, 3)])
def test_measure_seconds_counts_the_readouts_a_measured_round_really_adds(k, d, read):
    """An independent count: the engine's readouts of each round, measured minus unmeasured, priced at one second
    per readout (then one second per position read out); reading out every depth below full, or only `read`."""
    from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig

    adapter = load("ouro")
    depth = adapter.full_depth
    prompts = [[5, 9, 13, 200], [7, 7, 30], [100, 3]]
    per_round = {}
    for measure in (False, True):
        engine = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=k, d=d, measure_depths=measure))
        if read is not None:  # as an adaptive engine's runner reads its options' draft depths
            engine.runner.readout_depths = frozenset(read)
        rounds: list[list] = []
        runner, run = engine.runner, engine.spec_round.run
        readout = runner.readout

        def counting(state, at, ctx, readout=readout, rounds=rounds):
            if rounds:
                rounds[-1].append(state.shape[0])
            return readout(state, at, ctx)

        def one_round(requests, ks, d_, measure_depths=False, stop_margin=None, run=run, rounds=rounds):
            rounds.append([list(ks)])
            return run(requests, ks, d_, measure_depths, stop_margin)

        runner.readout, engine.spec_round.run = counting, one_round
        engine.generate(prompts, SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))
        per_round[measure] = rounds
    assert len(per_round[True]) == len(per_round[False])
    zero = {"readout_seconds": [0.0, 0.0]}
    per_readout = PassCost(config(**{**zero, "readout_seconds": [1.0, 0.0]}), depth, readout_depths=read)
    per_position = PassCost(config(**{**zero, "readout_seconds": [0.0, 1.0]}), depth, readout_depths=read)
    # the rounds where every request drafts K (near its end a request drafts fewer)
    full = [r for r in zip(per_round[False], per_round[True]) if r[0][0] == [k] * len(prompts)]
    assert len(full) >= 2
    for plain, measured in full:
        assert measured[0] == plain[0]  # the same rounds: greedy drafts do not depend on measuring
        count, positions = len(measured) - len(plain), sum(measured[1:]) - sum(plain[1:])
        assert per_readout.measure_seconds(k, d, len(prompts)) == pytest.approx(count), (plain, measured)
        assert per_position.measure_seconds(k, d, len(prompts)) == pytest.approx(positions), (plain, measured)


def test_drift_converges_to_a_constant_ratio():
    cost = PassCost(config(), D, drift_rounds=16.0)
    for _ in range(400):
        cost.observe(2.5 * 0.01, 0.01)
    assert cost.drift == pytest.approx(2.5, rel=1e-4)
    for _ in range(400):
        cost.observe(0.4 * 0.03, 0.03)
    assert cost.drift == pytest.approx(0.4, rel=1e-4)


@pytest.mark.parametrize("rounds", [16.0, 64.0])
def test_drift_remembers_about_drift_rounds(rounds):
    """A step change of the machine (x1.3, inside the clip) is half followed after about ln 2 * drift_rounds rounds."""
    cost = PassCost(config(), D, drift_rounds=rounds)
    n = 0
    while math.log(cost.drift) < 0.5 * math.log(1.3):
        cost.observe(1.3, 1.0)
        n += 1
    assert 0.5 * rounds <= n <= rounds, n


def test_one_wild_round_moves_the_drift_by_at_most_the_clipped_step():
    rounds = 64.0
    for wild in (100.0, 0.01):
        cost = PassCost(config(), D, drift_rounds=rounds)
        for _ in range(50):
            cost.observe(0.02, 0.02)
        assert cost.drift == pytest.approx(1.0)
        cost.observe(wild * 0.02, 0.02)
        moved = abs(math.log(cost.drift))
        assert 0.0 < moved <= 0.5 / rounds + 1e-12, (wild, cost.drift)
    cost.observe(0.0, 0.02)  # no measurement: nothing moves
    cost.observe(0.02, 0.0)
    assert abs(math.log(cost.drift)) <= 0.5 / rounds + 1e-12


def test_predict_scales_with_the_drift():
    cost = PassCost(config(), D, drift_rounds=4.0, options=[(3, 1)])
    before = {(k, d): cost.predict(k, d, 6, 40.0) for k, d in [(0, 0), (3, 1), (2, 2)]}
    assert before[(3, 1)] == pytest.approx(by_hand(3, 1, 6, 40.0), rel=1e-9)
    for _ in range(200):
        cost.observe(3.0, 1.0)
    assert cost.drift == pytest.approx(3.0, rel=1e-6)
    for (k, d), seconds in before.items():
        assert cost.predict(k, d, 6, 40.0) == pytest.approx(3.0 * seconds, rel=1e-6)
        assert cost.seconds(k, d, 6, 40.0) == pytest.approx(seconds, rel=1e-12)  # the profile itself is kept


def test_ideal_cost_is_a_valid_profile_whose_pass_grows_with_its_width():
    cost = PassCost(CostConfig.model_validate(ideal_cost(32)), D)
    seconds = [cost.profile_seconds([0], [0], b, 0.0)[0] for b in (1, 32, 256)]
    assert seconds == sorted(seconds)
    # a pass over n positions costs 1 + n / n_sat units: D passes and a readout of 8 % of that
    assert seconds[1] == pytest.approx(D * 1e-3 * 2.0 + 1e-3 * 0.08 * 2.0, rel=1e-9)


def test_loops_that_exit_before_they_run_read_no_more_context():
    """With every token exiting at loop 1, drafting at d = 2 runs the same single loop as at d = 1: the context the
    draft steps add is read by the passes that run only."""
    cost = PassCost(config(), D)
    first = np.array([1.0, 0.0, 0.0, 0.0])
    for b, context in [(1, 10.0), (8, 120.0)]:
        at1, at2 = cost.profile_seconds([3, 3], [1, 2], b, context, first)
        assert at2 == pytest.approx(at1, rel=1e-12)


def test_exits_narrow_the_passes_only_in_skip_mode():
    # select mode runs every loop whatever the exit: the round costs what it costs without early exit
    cost = PassCost(config(), D, options=[(2, 1), (3, 2)])
    select, skip = ExitDepths(D, memory=64.0), ExitDepths(D, memory=64.0)
    assert not skip.prices_passes and skip.survival() is None  # nothing seen yet
    select.observe([1, 1, 2, 4], skips=False)
    skip.observe([1, 1, 2, 4], skips=True)
    assert not select.prices_passes and select.survival() is None
    assert skip.prices_passes and skip.survival() is not None
    plain = cost.seconds(3, 2, 6, 50.0)
    assert cost.seconds(3, 2, 6, 50.0, select) == pytest.approx(plain, rel=1e-12)
    assert cost.seconds(3, 2, 6, 50.0, skip) < plain


@pytest.mark.parametrize("depths", [[1], [1, 2, 2, 4], [2, 3, 3, 3, 4], [4]])
def test_a_plain_round_of_one_request_in_skip_mode_runs_its_mean_exit_depth_in_loops(depths):
    # a shipped preset's costs; one request, one token a round: in skip mode its token runs loops 1..e and stops at
    # its exit depth e, so over the histogram a plain round runs E[e] one-position passes where it ran D without exits
    preset = read_preset_file(shipped_preset_path("ouro-1.4b"))
    depth, c = preset.full_depth, preset.cost
    cost = PassCost(c, depth)
    exits = ExitDepths(depth, memory=64.0)
    exits.observe(depths, skips=True)
    mean_depth = sum(depths) / len(depths)
    for context in (0.0, 300.0):
        # one pass over one position of one request: w(1) (the first grid point is 1) and the context terms
        assert c.positions[0] == 1
        one_pass = (
            c.pass_seconds[0] + c.request_seconds + (c.request_context_seconds + c.query_context_seconds) * context
        )
        every_loop = cost.seconds(0, 0, 1, context)
        want = every_loop - (depth - mean_depth) * one_pass
        assert cost.seconds(0, 0, 1, context, exits) == pytest.approx(want, rel=1e-9), context
