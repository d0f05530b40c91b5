"""What the plans committed on this text (control/realized.py): the chain's error per depth, shared by every K."""

from __future__ import annotations

import pytest
from test_acceptance_cost import profiled_config

from looped_spec.control import AdaptiveController
from looped_spec.control.acceptance import markov_tokens
from looped_spec.control.plan import RoundFeedback
from looped_spec.control.realized import BIAS_MEMORY, BIAS_PRIOR, REALIZED_MIN, RealizedTokens


def round_of(k: int, d: int, accepted: list[int], proposed: list[int] | None = None, **kw) -> RoundFeedback:
    proposed = [k] * len(accepted) if proposed is None else proposed
    return RoundFeedback(0, k, d, 0, 0, len(accepted), proposed, accepted, **kw)


def test_the_chains_error_is_accepted_over_predicted_per_depth_shrunk_to_the_pooled_one():
    """Recomputed by hand: discounted sums of accepted and predicted tokens (every round's committed positions
    fade them by BIAS_MEMORY / (BIAS_MEMORY + committed)), the depth's ratio shrunk to the pooled ratio, that to 1."""
    realized = RealizedTokens()
    assert realized.error(1) == realized.error(3) == 1.0
    sums = {0: [0.0, 0.0], 1: [0.0, 0.0], 2: [0.0, 0.0]}
    rounds = [  # (k, d, accepted per request, proposed per request, chain tokens per request-round)
        (1, 1, [1, 1, 0, 1], None, 1.5),
        (2, 1, [2, 1, 2, 0], None, 2.0),
        (0, 0, [0] * 6, None, 1.0),  # plain: fades, adds nothing
        (3, 2, [0, 1, 2], [3, 3, 2], 2.2),  # the third request drafted 2 < K: left out
        (2, 1, [2, 2], None, 1.8),
        (2, 2, [2, 2, 1], None, 2.5, [4]),  # early exit: left out (ExitDepths' business)
    ]
    for k, d, accepted, proposed, chain, *exits in rounds:
        fb = round_of(k, d, accepted, proposed, exit_depths=exits[0] if exits else [])
        committed = sum(accepted) + len(accepted)
        realized.observe(fb, committed, chain)
        keep = BIAS_MEMORY / (BIAS_MEMORY + committed)
        for pair in sums.values():
            pair[0] *= keep
            pair[1] *= keep
        if k and not exits:
            full = [a for a, p in zip(accepted, proposed or [k] * len(accepted)) if p == k]
            for key in (0, d):
                sums[key][0] += sum(full)
                sums[key][1] += len(full) * (chain - 1.0)
    pooled = (sums[0][0] + BIAS_PRIOR) / (sums[0][1] + BIAS_PRIOR)
    for d in (1, 2):
        assert realized.error(d) == pytest.approx((sums[d][0] + BIAS_PRIOR * pooled) / (sums[d][1] + BIAS_PRIOR))
    assert realized.error(3) == pytest.approx(pooled)  # a depth never run: the pooled ratio
    assert realized.error(1) > pooled > realized.error(2) and pooled > 1.0  # depth 2 fell short of its chain
    # every K at a depth is corrected alike, on its accepted tokens, within [1, K + 1]
    for k in (1, 3, 5):
        chain = markov_tokens(0.6, 0.3, k)
        assert realized.tokens(k, 1, chain) == pytest.approx(1.0 + (chain - 1.0) * realized.error(1))
    assert realized.tokens(1, 1, 1.99) == 2.0
    assert realized.tokens(0, 0, 1.0) == 1.0


def test_a_plan_never_run_is_priced_with_its_depths_error():
    """The motivating case (tiny-ouro, B = 8): (1, 1) ran and committed more than the chain with the tuned ρ
    predicts; (3, 1), never run, is priced up by the same ratio, (2, 2) by the pooled one, and the plan that
    ran by its own tokens once it has REALIZED_MIN request-rounds."""
    ctl = AdaptiveController(profiled_config([0.5, 0.6, 0.7, 1.0]), 4)
    policy = ctl.policy
    before = {kd: policy.tokens(*kd) for kd in ((1, 1), (3, 1), (2, 2))}
    for _ in range(60):  # 8 requests, 7 of which accept their draft: 0.875 vs a chain at α_1 = 0.5
        policy.observe(RoundFeedback(0, 1, 1, 0, 0, 8, [1] * 8, [1] * 7 + [0]))
    assert policy.acceptance.alpha(1) == pytest.approx(0.5)  # no readouts: α_1 did not move
    error1, pooled = policy.realized.error(1), policy.realized.error(2)
    assert error1 > pooled > 1.0
    for (k, d), error in (((3, 1), error1), ((2, 2), pooled)):
        assert policy.tokens(k, d) == pytest.approx(1.0 + (before[(k, d)] - 1.0) * error)
    seen = policy.realized_of(1, 1)
    assert seen is not None and seen[1] >= REALIZED_MIN
    assert seen[0] / seen[1] == pytest.approx(1.875)
    assert before[(1, 1)] < policy.tokens(1, 1) < 1.875  # its own tokens, the corrected chain as a prior


def test_a_depths_measured_error_is_token_evidence_that_outlasts_the_plans_own_tokens():
    """Evidence of tokens (for the evidence margin) is the plan's own REALIZED_MIN request-rounds, or its depth's
    error resting on BIAS_PRIOR expected accepted tokens; the plan's own tokens fade within ~REALIZED_MEMORY
    positions, the depth's error over BIAS_MEMORY, so a trial's evidence survives the next batches of plain."""
    realized = RealizedTokens()
    assert not realized.measured(1, 1)
    for _ in range(40):  # (1, 1) at B = 8: 320 request-rounds, chain 1.6 -> 192 expected accepted tokens
        realized.observe(round_of(1, 1, [1] * 5 + [0] * 3), 13, 1.6)
    assert realized.measured(1, 1) and not realized.measured(3, 1)  # ~180 faded < BIAS_PRIOR: only its own
    for _ in range(40):
        realized.observe(round_of(1, 1, [1] * 5 + [0] * 3), 13, 1.6)
    assert realized.errors.get(1)[1] >= BIAS_PRIOR
    assert realized.measured(3, 1) and not realized.measured(1, 2)  # the depth's error covers every K at d = 1
    assert realized.measured(1, 1, own=True) and not realized.measured(3, 1, own=True)  # own: the plan's tokens
    for _ in range(150):  # 1200 positions of plain decoding
        realized.observe(round_of(0, 0, [0] * 8), 8, 1.0)
    assert realized.of(1, 1)[1] < REALIZED_MIN  # its own tokens have faded ...
    assert realized.measured(1, 1) and realized.measured(3, 1)  # ... the depth's error has not
    assert not realized.measured(1, 1, own=True)
