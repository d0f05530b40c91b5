"""Acceptance: how many drafted tokens a depth-d draft gets accepted (docs/adaptive.md "Acceptance").

Per draft depth d two numbers describe the bits m_t(d) (the depth-d readout at position t-1 predicts the committed
token x_t): the agreement α_d and the persistence ρ_d = P(1 | 1) − P(1 | 0). `markov_tokens` prices a K-token
round by the two-state chain they define; `AcceptanceEstimator` learns α online from the preset's value, per
request too (plans are priced with what the requests they run on agree at); ρ is the preset's.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from looped_spec.control.plan import RoundFeedback


def markov_tokens(alpha: float, rho: float, k: int) -> float:
    """Expected committed tokens per request per round of a K-token draft (1 for K = 0)."""
    return markov_tokens_upto(alpha, rho, k)[max(k, 0)]


def markov_tokens_upto(alpha: float, rho: float, k_max: int) -> list[float]:
    """[k_max + 1]: `markov_tokens(alpha, rho, K)` for K = 0..k_max, in one pass (a decision prices every K of a
    depth at once).

    A round starts after a match only when all K drafts and the bonus token matched; π₁, the share of rounds that
    do, is the chain's stationary share with the factor (1 − ρ) common to its two terms taken out, so that it is
    continuous up to ρ = 1 (where both states' escapes vanish together and π₁ → α / ((K+1)(1 − α) + α))."""
    alpha = min(max(alpha, 0.0), 1.0)
    rho = min(max(rho, 0.0), 1.0)
    p01 = alpha * (1.0 - rho)  # P(match | previous position missed)
    p11 = rho + p01  # P(match | previous position matched)
    out = [1.0]
    run, power = 0.0, 1.0  # at K: run = 1 + p11 + ... + p11^(K-1), power = p11^K
    for _ in range(max(k_max, 0)):
        run += power
        power *= p11
        # accepted drafts: the first matches with p01 or p11 (the state the round starts in), each later one with
        # p11, so P(first) × run. π₁ = p01·p11^K / (1 − p11^(K+1) + p01·p11^K), both terms divided by (1 − ρ):
        # 1 − p11^(K+1) = (1 − p11)(1 + p11 + ... + p11^K) and 1 − p11 = (1 − α)(1 − ρ)
        to_one, stay = alpha * power, (1.0 - alpha) * (run + power)
        pi1 = to_one / (stay + to_one) if stay + to_one > 0.0 else 0.0
        out.append(1.0 + run * ((1.0 - pi1) * p01 + pi1 * p11))
    return out


def accept_rate(alpha: float, rho: float, k: int) -> float:
    """Expected ΣA/ΣK of K-token rounds (what the EMA policy measures); 0 for K = 0."""
    return (markov_tokens(alpha, rho, k) - 1.0) / k if k > 0 else 0.0


class AcceptanceEstimator:
    """α per draft depth 1..D from readouts and round outcomes, and per request of the batch (`batch_alpha`:
    docs/adaptive.md "The batch's own agreement"); ρ per depth as the preset measured it on the tuning text."""

    def __init__(
        self,
        depth: int,
        prior_alpha: Sequence[float] | None,
        prior_rho: Sequence[float] | None,
        prior_weight: float,
        memory: float,
        request_memory: float = 16.0,
        request_prior: float = 2.0,
    ) -> None:
        alpha = list(prior_alpha) if prior_alpha is not None else [0.0] * depth
        rho = list(prior_rho) if prior_rho is not None and prior_alpha is not None else [0.0] * depth
        for name, values in (("alpha", alpha), ("rho", rho)):
            if len(values) != depth:
                raise ValueError(f"acceptance prior has {len(values)} depths of {name}, the model {depth}")
        weight = prior_weight if prior_alpha is not None else 0.0
        self.depth = depth
        self.memory = memory
        # per depth, faded counts (plain floats: a handful of depths, updated every round)
        self.trials = [weight] * depth
        self.matches = [a * weight for a in alpha]
        # [D] P(agree | the previous position agreed) − P(agree | it did not); full depth always agrees (0)
        self.rho = [min(max(r, 0.0), 1.0) for r in rho[:-1]] + [0.0]
        self.positions = 0  # positions observed online (readouts and round outcomes)
        self._alpha: list[float] | None = None
        # per request of the batch, faded [matches[D], trials[D]] of its own positions; the batch's estimate pools
        # them with `request_prior` positions of the overall α per request
        self.request_memory, self.request_prior = request_memory, request_prior
        self.requests: dict[str, list[list[float]]] = {}
        self.batch: Sequence[str] = ()  # the requests the next plan runs on (`set_batch`)

    # ------------------------------------------------------------------ estimates
    @property
    def alpha(self) -> list[float]:
        """[D] agreement per depth (computed when read: decisions read it every few rounds, rounds add to it)."""
        if self._alpha is None:
            alpha = [m / t if t > 0.0 else 0.0 for m, t in zip(self.matches, self.trials)]
            alpha[-1] = 1.0  # full depth agrees with itself
            self._alpha = alpha
        return self._alpha

    def set_batch(self, request_ids: Sequence[str]) -> None:
        """The requests the next plan runs on. The others' own counts are dropped: a request out of the batch
        (finished, preempted, or waiting while a suspect runs alone after a failed step) starts again from the
        overall estimate when it comes back, and so does a new request under an id a finished one had, unless no
        plan came between them."""
        self.batch = request_ids
        live = set(request_ids)
        if not live.issuperset(self.requests):
            self.requests = {i: c for i, c in self.requests.items() if i in live}

    def batch_alpha(self) -> list[float]:
        """[D] agreement of the batch's requests: their own positions pooled, each with `request_prior` positions of
        the overall α (which alone stands for a request not seen yet, and for no batch)."""
        alpha = self.alpha
        if not self.batch:
            return alpha
        weight = self.request_prior * len(self.batch)
        # per depth, the prior then each request's counts in batch order (`sum` with a start: one column at a time)
        own = [counts for counts in map(self.requests.get, self.batch) if counts is not None]
        if own:
            matches = [sum(column, weight * a) for column, a in zip(zip(*(c[0] for c in own)), alpha)]
            trials = [sum(column, weight) for column in zip(*(c[1] for c in own))]
        else:
            matches, trials = [weight * a for a in alpha], [weight] * self.depth
        out = [m / t if t > 0.0 else a for m, t, a in zip(matches, trials, alpha)]
        out[-1] = 1.0
        return out

    def tokens_upto(self, alpha: Sequence[float], k_max: dict[int, int]) -> dict[int, list[float]]:
        """Per draft depth d of `k_max`, expected committed tokens per request per round of (K, d) for K = 0..k_max[d]
        at agreement `alpha` ([D])."""
        return {d: markov_tokens_upto(alpha[d - 1], self.rho[d - 1], k) for d, k in k_max.items()}

    # ------------------------------------------------------------------ observations
    def _add(self, j: int, matches: float, trials: float) -> None:
        _fade_in(self.matches, self.trials, j, matches, trials, self.memory)
        self._alpha = None

    def observe_readouts(self, matches: Sequence[int], trials: Sequence[int]) -> None:
        """A measured round: per depth, how many committed positions its readout predicted, out of how many."""
        if len(trials) != self.depth or not max(trials):
            return
        for j in range(self.depth):
            if trials[j]:
                self._add(j, matches[j], trials[j])
        self.positions += max(trials)

    def observe_drafts(self, d: int, accepted: int, rejected: int) -> None:
        """An unmeasured speculative round at depth d: its drafts accepted, and the drafts rejected (each
        request stops at its first rejection, so the bits after it are unknown)."""
        if not 1 <= d <= self.depth or accepted + rejected == 0:
            return
        self._add(d - 1, accepted, accepted + rejected)
        self.positions += accepted + rejected

    def _request_counts(self, request_id: str) -> list[list[float]]:
        """The request's own faded [matches[D], trials[D]], created empty."""
        counts = self.requests.get(request_id)
        if counts is None:
            counts = self.requests[request_id] = [[0.0] * self.depth, [0.0] * self.depth]
        return counts

    # the two below fade a request's counts as `_fade_in` does, written out: they run once per request per round
    def observe_request_readouts(
        self, request_ids: Sequence[str], matches: Sequence[Sequence[int]], trials: Sequence[int],
        read: Sequence[int] | None = None,
    ) -> None:  # fmt: skip
        """A measured round per request: how many of its committed positions each depth predicted, out of how many
        (at the depths `read`, the round's trials per depth, is not 0 at; None: every depth)."""
        memory = self.request_memory
        depths = range(self.depth) if read is None else [j for j, n in enumerate(read) if n]
        for request_id, row, n in zip(request_ids, matches, trials):
            if n:
                own_matches, own_trials = self._request_counts(request_id)
                fade = memory / (memory + n)
                for j in depths:
                    own_matches[j] = fade * own_matches[j] + row[j]
                    own_trials[j] = fade * own_trials[j] + n

    def observe_request_drafts(
        self, request_ids: Sequence[str], d: int, accepted: Sequence[int], proposed: Sequence[int]
    ) -> None:
        """An unmeasured speculative round per request, as `observe_drafts`."""
        if not 1 <= d <= self.depth:
            return
        j, memory, requests = d - 1, self.request_memory, self.requests
        for request_id, a, k in zip(request_ids, accepted, proposed):
            if k:
                counts = requests.get(request_id)  # `_request_counts` inline: this loop runs every speculative round
                own_matches, own_trials = counts if counts is not None else self._request_counts(request_id)
                n = a + (a < k)
                fade = memory / (memory + n)
                own_matches[j] = fade * own_matches[j] + a
                own_trials[j] = fade * own_trials[j] + n

    def observe_round(self, fb: RoundFeedback) -> None:
        """Everything a committed round says about agreement: a measured round its readouts, an unmeasured
        speculative round its drafts' outcomes at the planned depth (not under early exit, where the bits include
        free exits)."""
        if fb.depth_trials:
            self.observe_readouts(fb.depth_matches, fb.depth_trials)
            self.observe_request_readouts(fb.request_ids, fb.request_matches, fb.request_trials, fb.depth_trials)
        elif fb.k > 0 and not fb.exit_depths:
            rejected = sum(map(operator.lt, fb.num_accepted, fb.num_proposed))
            self.observe_drafts(fb.d, fb.total_accepted, rejected)
            self.observe_request_drafts(fb.request_ids, fb.d, fb.num_accepted, fb.num_proposed)


def _fade_in(
    matches: list[float], trials: list[float], j: int, new_matches: float, new_trials: float, memory: float
) -> None:
    """Depth j's faded counts take in new positions; about `memory` positions are remembered."""
    fade = memory / (memory + new_trials)
    matches[j] = fade * matches[j] + new_matches
    trials[j] = fade * trials[j] + new_trials
