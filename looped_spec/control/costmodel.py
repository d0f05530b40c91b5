"""Round-time model fitted online from measured phase times (used by the goodput policy).

One loop step over N token positions is modelled as linear in N, separately for the two kernels shapes:

    draft  ≈ d(K+1) · (a0 + a1·B)          d(K+1) loop steps of one token per request
    plain  ≈ D      · (a0 + a1·B)          plain decoding is D such steps (fitted together with draft)
    verify ≈ (D−d)  · (b0 + b1·B(K+1))     D−d loop steps over all K+1 positions of every request
    commit ≈ g0 + g1·B(K+1)                acceptance, KV truncation, bookkeeping

Each line is a two-parameter non-negative least-squares fit with exponential forgetting (recent rounds
weigh more, so the fit follows slow drift such as growing context lengths). A plain round's time is
`draft_time + full_depth_time` (whichever phase the engine booked it under). Without any timing the model
falls back to counting loop steps: draft d(K+1), verify D−d, plain D
(memory-bound: a loop step costs the same for 1 or K+1 tokens).
"""

from __future__ import annotations


class LinearFit2:
    """y ≈ p0·x0 + p1·x1 with p0, p1 >= 0; O(1) per sample, exponential forgetting `decay` per sample."""

    __slots__ = ("decay", "s00", "s01", "s11", "s0y", "s1y", "syy", "weight", "_p", "_stale")

    def __init__(self, decay: float = 0.995) -> None:
        self.decay = decay
        self.s00 = self.s01 = self.s11 = self.s0y = self.s1y = self.syy = self.weight = 0.0
        self._p = (0.0, 0.0)
        self._stale = False

    def add(self, x0: float, x1: float, y: float) -> None:
        g = self.decay
        self.s00 = g * self.s00 + x0 * x0
        self.s01 = g * self.s01 + x0 * x1
        self.s11 = g * self.s11 + x1 * x1
        self.s0y = g * self.s0y + x0 * y
        self.s1y = g * self.s1y + x1 * y
        self.syy = g * self.syy + y * y
        self.weight = g * self.weight + 1.0
        self._stale = True

    @property
    def has_data(self) -> bool:
        return self.weight > 0.0

    def params(self) -> tuple[float, float]:
        """Least-squares (p0, p1), clamped to the best non-negative fit; solved lazily after new data."""
        if self._stale:
            self._p = self._solve()
            self._stale = False
        return self._p

    def _sse(self, p0: float, p1: float) -> float:
        return (
            self.syy
            - 2.0 * (p0 * self.s0y + p1 * self.s1y)
            + p0 * p0 * self.s00
            + 2.0 * p0 * p1 * self.s01
            + p1 * p1 * self.s11
        )

    def _solve(self) -> tuple[float, float]:
        ridge = 1e-9 * (self.s00 + self.s11) + 1e-300
        a, b, c = self.s00 + ridge, self.s01, self.s11 + ridge
        det = a * c - b * b
        if det > 0.0:
            p0 = (c * self.s0y - b * self.s1y) / det
            p1 = (a * self.s1y - b * self.s0y) / det
            if p0 >= 0.0 and p1 >= 0.0:
                return p0, p1
        # the unconstrained optimum is infeasible: the best fit lies on a boundary (one parameter 0)
        only0 = (max(self.s0y / a, 0.0), 0.0)
        only1 = (0.0, max(self.s1y / c, 0.0))
        return only0 if self._sse(*only0) <= self._sse(*only1) else only1

    def predict(self, x0: float, x1: float) -> float:
        p0, p1 = self.params()
        return p0 * x0 + p1 * x1


class RoundCostModel:
    """Predicted seconds of one round with K draft tokens at draft depth d for a batch of B, at depth D."""

    __slots__ = ("full_depth", "draft", "verify", "commit")

    def __init__(self, full_depth: int, decay: float = 0.995) -> None:
        self.full_depth = full_depth
        self.draft = LinearFit2(decay)
        self.verify = LinearFit2(decay)
        self.commit = LinearFit2(decay)

    def observe(
        self, k: int, d: int, batch: int, draft_time: float, full_depth_time: float, commit_time: float
    ) -> None:
        """Fold in one round's measured phase times (rounds without timings are ignored)."""
        if batch <= 0 or draft_time + full_depth_time + commit_time <= 0.0:
            return
        depth = self.full_depth
        if k == 0:
            self.draft.add(depth, depth * batch, draft_time + full_depth_time)
            self.commit.add(1.0, batch, commit_time)
            return
        steps = d * (k + 1)
        self.draft.add(steps, steps * batch, draft_time)
        self.verify.add(depth - d, (depth - d) * batch * (k + 1), full_depth_time)
        self.commit.add(1.0, batch * (k + 1), commit_time)

    @property
    def timed(self) -> bool:
        """True once both kernel shapes have been timed (predictions are then in seconds)."""
        return self.draft.has_data and self.verify.has_data

    def predict(self, k: int, d: int, batch: int) -> float:
        """Seconds per round when `timed`, else loop steps (comparable across candidates either way)."""
        depth = self.full_depth
        if not self.timed:
            return float(depth if k == 0 else d * (k + 1) + depth - d)
        if k == 0:
            t = self.draft.predict(depth, depth * batch) + self.commit.predict(1.0, batch)
        else:
            steps = d * (k + 1)
            t = (
                self.draft.predict(steps, steps * batch)
                + self.verify.predict(depth - d, (depth - d) * batch * (k + 1))
                + self.commit.predict(1.0, batch * (k + 1))
            )
        return max(t, 1e-12)
