"""Acceptance: how many drafted tokens a depth-d draft gets accepted (docs/adaptive.md "Acceptance").

Along the committed tokens x_1, x_2, ... let m_t(d) = 1 when the depth-d readout at position t-1 predicts x_t.
A depth-d draft proposes exactly those readouts while its prefix is right, so a K-token round accepts the
run of ones that follows the last committed token, capped at K. Two numbers per depth describe the bits:
the agreement α_d (the share of ones) and the persistence ρ_d = P(1 | 1) − P(1 | 0) (matches come in runs).
`markov_tokens` is the expected committed tokens per round of that two-state chain; ρ = 0 gives the
geometric (1 − α^{K+1}) / (1 − α).

`AcceptanceEstimator` learns both online, starting from the preset's (the tuning text's) values:
- α_d from counterfactual readouts (a measured round reads out every depth on its committed positions:
  unbiased bits for every depth at once) and from the speculative rounds' own outcomes (the planned depth's
  bits until the first rejection); the prior counts as `prior_weight` positions and older positions fade so
  that the estimate remembers about `memory` of them. A second estimate remembers only `CHANGE_MEMORY`
  positions; when it leaves the first by more than `change_z` standard errors the text has changed (a workload
  switched), and the first restarts from it instead of forgetting the old text over `memory` positions.
- ρ_d from pairs of consecutive positions read out (within a measured round, and across two measured rounds
  in a row: the readouts come in pairs of rounds), the same lag-1 statistic the tuner measures: the prior counts
  as `prior_weight` pairs, older pairs fade like positions. Texts differ in how matches cluster (the tuning
  text's runs are longer than torch's code's), and ρ decides how much a long draft gains over a short one.
"""

from __future__ import annotations

import math
from collections.abc import Sequence


def markov_tokens(alpha: float, rho: float, k: int) -> float:
    """Expected committed tokens per request per round of a K-token draft (1 for K = 0)."""
    if k <= 0:
        return 1.0
    alpha = min(max(alpha, 0.0), 1.0)
    rho = min(max(rho, 0.0), 1.0)
    p01 = alpha * (1.0 - rho)  # P(match | previous position missed)
    p11 = rho + p01  # P(match | previous position matched)
    pk = p11**k
    run = float(k) if p11 >= 1.0 else (1.0 - pk) / (1.0 - p11)
    # the next round starts after a match only when all K drafts and the bonus token matched
    to_one_from_0 = p01 * pk
    denom = 1.0 - p11 * pk + to_one_from_0
    pi1 = 1.0 if denom <= 0.0 else to_one_from_0 / denom
    return 1.0 + run * ((1.0 - pi1) * p01 + pi1 * p11)


def accept_rate(alpha: float, rho: float, k: int) -> float:
    """Expected ΣA/ΣK of K-token rounds (what the EMA policy measures); 0 for K = 0."""
    return (markov_tokens(alpha, rho, k) - 1.0) / k if k > 0 else 0.0


#: Positions the change detector's short estimate remembers
CHANGE_MEMORY = 32.0


class AcceptanceEstimator:
    """α and ρ per draft depth 1..D (see the module docstring)."""

    def __init__(
        self,
        depth: int,
        prior_alpha: Sequence[float] | None,
        prior_rho: Sequence[float] | None,
        prior_weight: float,
        memory: float,
        change_z: float | None = 3.0,
    ) -> None:
        alpha = list(prior_alpha) if prior_alpha is not None else [0.0] * depth
        if len(alpha) != depth:
            raise ValueError(f"acceptance prior has {len(alpha)} depths, the model {depth}")
        weight = prior_weight if prior_alpha is not None else 0.0
        self.depth = depth
        self.memory = memory
        self.change_z = change_z
        self.prior_weight = prior_weight
        # per depth, faded counts (plain floats: a handful of depths, updated every round)
        self.trials = [weight] * depth
        self.matches = [a * weight for a in alpha]
        self.recent_trials = [0.0] * depth
        self.recent_matches = [0.0] * depth
        self.prior_rho = list(prior_rho) if prior_rho is not None else [0.0] * depth
        # per depth, faded counts of consecutive readout pairs [n1, n11, n0, n01], starting at the prior's
        self.pairs = [self._prior_pairs(j, alpha[j]) for j in range(depth)]
        self.positions = 0  # positions observed online (readouts and round outcomes)
        self.changes = 0  # times the text was seen to change
        self._unchecked = 0.0  # positions added since the last change check
        self._alpha: list[float] | None = None
        self._rho: list[float] | None = None

    def _prior_pairs(self, j: int, alpha: float) -> list[float]:
        """`prior_weight` pairs of a chain with agreement `alpha` and the preset's persistence at depth j."""
        w, rho = self.prior_weight, self.prior_rho[j]
        p01 = alpha * (1.0 - rho)
        return [w * alpha, w * alpha * (rho + p01), w * (1.0 - alpha), w * (1.0 - alpha) * p01]

    # ------------------------------------------------------------------ estimates
    @property
    def alpha(self) -> list[float]:
        """[D] agreement per depth (computed when read: decisions read it every few rounds, rounds add to it)."""
        if self._alpha is None:
            alpha = [m / t if t > 0.0 else 0.0 for m, t in zip(self.matches, self.trials)]
            alpha[-1] = 1.0  # full depth agrees with itself
            self._alpha = alpha
        return self._alpha

    @property
    def rho(self) -> list[float]:
        """[D] persistence per depth: P(agree | the previous position agreed) − P(agree | it did not)."""
        if self._rho is None:
            rho = [min(max(n11 / max(n1, 1e-12) - n01 / max(n0, 1e-12), 0.0), 1.0) for n1, n11, n0, n01 in self.pairs]
            rho[-1] = 0.0  # full depth always agrees: nothing to persist, and never drafted
            self._rho = rho
        return self._rho

    def tokens(self, k: int, d: int, alpha: Sequence[float] | None = None) -> float:
        """Expected committed tokens per request per round of a (K, d) plan (K = 0: 1)."""
        if k <= 0:
            return 1.0
        alpha = self.alpha if alpha is None else alpha
        return markov_tokens(alpha[d - 1], self.rho[d - 1], k)

    # ------------------------------------------------------------------ observations
    def _add(self, j: int, matches: float, trials: float) -> None:
        fade = self.memory / (self.memory + trials)  # about `memory` positions remembered per depth
        self.matches[j] = fade * self.matches[j] + matches
        self.trials[j] = fade * self.trials[j] + trials
        fade = CHANGE_MEMORY / (CHANGE_MEMORY + trials)
        self.recent_matches[j] = fade * self.recent_matches[j] + matches
        self.recent_trials[j] = fade * self.recent_trials[j] + trials
        self._alpha = None

    def _check_change(self, added: float) -> None:
        """Every quarter window of new positions: restart a depth's estimate from its recent positions when they
        disagree with it by more than `change_z` standard errors (the text changed)."""
        self._unchecked += added
        if self.change_z is None or self._unchecked < CHANGE_MEMORY / 4:
            return
        self._unchecked = 0.0
        changed = False
        for j in range(self.depth):
            recent = self.recent_trials[j]
            if recent < CHANGE_MEMORY / 2:
                continue
            long = self.matches[j] / max(self.trials[j], 1e-12)
            short = self.recent_matches[j] / recent
            if abs(short - long) > self.change_z * math.sqrt(max(long * (1.0 - long), 0.01) / recent):
                self.matches[j], self.trials[j] = self.recent_matches[j], recent
                self.pairs[j] = self._prior_pairs(j, short)  # the old text's runs say nothing about the new one's
                changed = True
        if changed:
            self.changes += 1
            self._alpha = self._rho = None

    def observe_readouts(self, matches: Sequence[int], trials: Sequence[int]) -> None:
        """A measured round: per depth, how many committed positions its readout predicted, out of how many."""
        if len(trials) != self.depth or not max(trials):
            return
        for j in range(self.depth):
            if trials[j]:
                self._add(j, matches[j], trials[j])
        self.positions += max(trials)
        self._check_change(max(trials))

    def observe_drafts(self, d: int, accepted: int, rejected: int) -> None:
        """An unmeasured speculative round at depth d: its drafts accepted, and the drafts rejected (each
        request stops at its first rejection, so the bits after it are unknown)."""
        if not 1 <= d <= self.depth or accepted + rejected == 0:
            return
        self._add(d - 1, accepted, accepted + rejected)
        self.positions += accepted + rejected
        self._check_change(accepted + rejected)

    def observe_pairs(self, pairs: Sequence[Sequence[int]]) -> None:
        """Per depth, counts [n1, n11, n0, n01] of consecutive readout pairs."""
        if len(pairs) != self.depth:
            return
        for j, counts in enumerate(pairs):
            n = counts[0] + counts[2]
            if n:
                fade = self.memory / (self.memory + n)
                self.pairs[j] = [fade * old + new for old, new in zip(self.pairs[j], counts)]
        self._rho = None
