"""What early exit does to a plan's predicted goodput (docs/adaptive.md, "Early exit").

With early exit the target is the early-exit model: a token's forward runs e loops, its exit depth. The
goodput policy keeps, per bucket, a decayed histogram of the exit depths of committed tokens (`RoundFeedback.
exit_depths`) and adjusts both factors of goodput:

- Tokens. A drafted position that exits within the draft (e <= d) is the target's own sample and is always
  accepted; only the others are verified, and the online α_d is learned from those alone. So the
  acceptance a (K, d) plan sees is α_eff(d) = P(e <= d) + (1 - P(e <= d)) · α_d.
- Cost (skip mode only; select mode runs every loop). A plain round runs E[e] of its D loops per token: its
  loop part, D·c_shallow of the profile's fit, shrinks by E[e]/D. A speculative round's draft runs
  E[min(e, d)] of its d loops per position, and its verify pass's per-query part (D-d)·v_1·(K+1) shrinks by
  E[(e - d)+]/(D - d); its fixed part (D-d)·v_0 is paid unless every position of the batch exited within the
  draft (probability P(e <= d)^(B(K+1)), taking positions as independent); the round's other costs stay.
  The profile's prediction is scaled by the ratio of the adjusted model to the full-depth one, so its
  calibration against measured rounds is kept.
"""

from __future__ import annotations

from looped_spec.control.costprofile import CostProfile

#: per round, the weight of what came before (about 200 rounds of memory)
DECAY = 0.995


class ExitDepths:
    """Decayed counts of committed tokens per exit depth 1..D for one bucket."""

    __slots__ = ("counts", "skips")

    def __init__(self, full_depth: int) -> None:
        self.counts = [0.0] * full_depth
        self.skips = False

    def observe(self, depths: list[int], skips: bool) -> None:
        if not depths:
            return
        self.counts = [c * DECAY for c in self.counts]
        for e in depths:
            self.counts[min(max(e, 1), len(self.counts)) - 1] += 1.0
        self.skips = skips

    @property
    def seen(self) -> bool:
        return sum(self.counts) > 0.0

    def _expect(self, f) -> float:
        total = sum(self.counts)
        return sum(c * f(e) for e, c in enumerate(self.counts, start=1)) / total

    def exit_within(self, d: int) -> float:
        """P(e <= d)."""
        return self._expect(lambda e: 1.0 if e <= d else 0.0)

    def effective_alpha(self, alpha: float, d: int) -> float:
        """Acceptance of a depth-d draft: exits within d always pass; the others at the verified rate α."""
        p = self.exit_within(d)
        return p + (1.0 - p) * alpha

    def cost_factor(self, profile: CostProfile, k: int, d: int, batch: int, context: float | None) -> float:
        """Predicted seconds of a round with these exits ÷ without (1.0 in select mode)."""
        if not self.skips:
            return 1.0
        depth = profile.depth
        if k <= 0:
            draft, _, _, other = (max(t, 0.0) for t in profile.terms(0, depth, batch, context))  # D loops, 1 query
            full = max(draft + other, 1e-12)
            return max(draft * self._expect(lambda e: e) / depth + other, 0.0) / full
        draft, verify_fixed, verify_query, other = (max(t, 0.0) for t in profile.terms(k, d, batch, context))
        full = max(draft + verify_fixed + verify_query + other, 1e-12)
        draft_run = self._expect(lambda e: min(e, d)) / d
        verify_run = self._expect(lambda e: max(e - d, 0)) / (depth - d) if depth > d else 0.0
        verify_pass = 1.0 - self.exit_within(d) ** (max(batch, 1) * (k + 1))  # some position still loops
        return (draft * draft_run + verify_fixed * verify_pass + verify_query * verify_run + other) / full
