"""Pricing a plan by the time it takes to drain the running requests when no freed slot is refilled.

The goodput policy prices a plan per round: tokens per request per round × batch size ÷ round time. That is
the right objective while requests wait — a request that finishes early frees a slot the scheduler refills
at once. When nothing waits and the batch is static (admitted together: `request.is_static`; a server's
batch that takes requests in as they arrive is not), the running requests are all the work there is, and
speculation spreads them apart: every request accepts at its own rate (its text), so some finish early and
the slowest run on in rounds with fewer and fewer requests, whose cost per request is higher (a round's cost
grows less than its batch). Plain decoding keeps requests of equal budgets in step. Measured on tiny-ouro at
B = 8 (64 tokens, evaluation prompts): the per-round model ranked (2, 1) 9 % above plain, the batch ran 0.67
full on average and the plan measured 0.90x plain; replaying the prompts' own draft agreement through this
model (with the same cost profile) priced it 0.95x and ranked the fixed plans as measured (docs/adaptive.md
"Draining").

The model: request i has `remaining[i]` tokens to commit; its tokens per round under a plan are uncertain
through its text — its agreement is α + σ·z with z standard normal (σ: the spread of per-prompt agreement
the tuner measured, `AcceptanceConfig.spread`), evaluated at the midpoints of equal-probability slices of z.
The expected number of requests still running after r rounds is n(r) = Σ_i P(remaining_i / t_i > r)
(exact by linearity of expectation), and the expected drain time is Σ_r cost(n(r)) with the round cost
interpolated between whole batch sizes (close to E[cost(n)], the cost being near-affine in n).

How many slices: the drain's length is set by the batch's slowest request, and of B requests the slowest sits
near z ≈ −2 at B = 32, where 8 slices end at −1.53 (their outermost midpoint): with 8 slices the model put
draining (2, 2) on tiny-ouro at B = 32 at 0.944 of its lockstep price where a Monte Carlo over continuous z
gives 0.931 (and (2, 1): 0.908 against 0.891), and within 0.3 % of it with 2·B slices (`slices`); at B = 8 the
two slicings differ by at most 0.4 %.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import lru_cache
from statistics import NormalDist

import numpy as np

from looped_spec.control.acceptance import markov_tokens_array

#: Equal-probability slices of text difficulty a request's acceptance is spread over, at least ...
QUANTILES = 8
#: ... and this many per running request (the tail the slowest request of a large batch reaches), ...
SLICES_PER_REQUEST = 2
#: ... and at most this many: a decision prices ~10 plans over B·slices finish times each (at B = 256, 512 slices
#: would sort 131 072 a plan); 128 slices reach z = −2.66, near the slowest of 256 requests (≈ −2.8).
MAX_SLICES = 128


@lru_cache(maxsize=64)
def slice_z(count: int) -> np.ndarray:
    """[count] standard-normal values at the middle of `count` equal-probability slices (read-only)."""
    z = np.array([NormalDist().inv_cdf((q + 0.5) / count) for q in range(count)])
    z.setflags(write=False)
    return z


def slices(batch: int) -> int:
    """Slices of z for a batch of `batch` running requests."""
    return min(max(QUANTILES, SLICES_PER_REQUEST * batch), MAX_SLICES)


def request_rates(alpha: float, spread: float, rho: float, k: int, count: int = QUANTILES) -> np.ndarray:
    """[count] committed tokens per round of a request at each slice of agreement α + spread·z (K = 0: one slice
    of 1 token: plain decoding commits one token a round whatever the text)."""
    if k <= 0:
        return np.ones(1)
    return markov_tokens_array(alpha + spread * slice_z(count), rho, k)


def drain_seconds(remaining: Sequence[int], rates: Sequence[float], cost: np.ndarray) -> float:
    """Expected seconds until every running request has committed its `remaining` tokens.

    rates: [Q] equally likely tokens per round of one request; cost: [B+1] seconds of one round with
    n = 0..B requests (cost[0] = 0). Rounds are counted continuously (a request needs remaining / rate).
    """
    budget = np.asarray(remaining, dtype=np.float64)  # [B]
    speed = np.asarray(rates, dtype=np.float64)  # [Q]
    finish = np.sort((budget[:, None] / speed[None, :]).ravel())  # [B·Q] rounds each (request, slice) needs
    q = speed.shape[0]
    running = budget.shape[0] - np.arange(finish.shape[0]) / q  # [B·Q] expected requests before each finish
    rounds = np.diff(finish, prepend=0.0)  # [B·Q] rounds run at that occupancy
    per_round = np.interp(running, np.arange(cost.shape[0]), cost)
    return float(np.dot(rounds, per_round))


def drain_factor(remaining: Sequence[int], rates: Sequence[float], mean_rate: float, cost: np.ndarray) -> float:
    """Drain-priced tokens/s ÷ per-round-priced tokens/s of one plan (≤ 1 for requests of equal budgets).

    The per-round price assumes the batch stays full: Σ remaining tokens at B · `mean_rate` tokens per round
    and cost[B] per round.
    """
    batch = len(remaining)
    total = float(sum(remaining))
    if batch == 0 or total <= 0.0:
        return 1.0
    lockstep = total / (batch * mean_rate) * float(cost[batch])
    drained = drain_seconds(remaining, rates, cost)
    return lockstep / drained if drained > 0.0 else 1.0
