"""Acceptance given the draft's confidence, for per-token stopping plans (docs/adaptive.md "Per-token stopping").

A stopping plan (K, d, θ) drafts while the depth-d draft's top-two margin m stays ≥ θ (proposer.py,
`propose_until_unsure`). What it commits and drafts per round follows from two numbers per (d, θ), learned from the
drafts of speculative rounds at depth d (the margin of every proposed draft comes back with the round's feedback):
- s_θ = P(m ≥ θ): the share of draft positions the rule lets through;
- a_θ = P(accepted | m ≥ θ), relative to the agreement of all drafts at that depth (`relative_agreement`), so that
  the acceptance estimator's α_d (learned from readouts as well) stays the one source of the depth's agreement.

A position counts once its agreement is known: the drafts up to and including a round's first rejection. A round that
stopped at θ_c tells nothing about thresholds below θ_c (the drafts it did not propose were never checked): it
updates only the thresholds ≥ θ_c, where the draft it stopped at counts as a position the rule stops at.
"""

from __future__ import annotations

from collections.abc import Sequence


class DraftMargins:
    """Faded counts per draft depth and threshold (see the module docstring)."""

    def __init__(self, depth: int, thresholds: Sequence[float], memory: float, prior_weight: float = 0.0) -> None:
        self.thresholds = tuple(sorted(thresholds))
        self.memory = memory
        self.prior_weight = prior_weight
        t = len(self.thresholds)
        # per depth: [seen, accepted] over every checked draft of rounds that did not stop early ...
        self.all = [[0.0, 0.0] for _ in range(depth)]
        # ... and per threshold [seen, sure, sure and accepted]
        self.by_threshold = [[[0.0, 0.0, 0.0] for _ in range(t)] for _ in range(depth)]

    def observe(
        self, d: int, margins: Sequence[Sequence[float]], proposed: Sequence[int], accepted: Sequence[int],
        stop_margin: float | None,
    ) -> None:  # fmt: skip
        """One round at draft depth d: per request its drafts' margins (one more than it proposed when it stopped at
        an unsure draft, that draft's margin last), how many it proposed and how many were accepted."""
        if not 1 <= d <= len(self.all):
            return
        lowest = -1.0 if stop_margin is None else stop_margin
        counts = [[0, 0, 0] for _ in self.thresholds]
        seen = hits = 0
        for m, k, a in zip(margins, proposed, accepted):
            if len(m) < k:  # its margins were not reported (a round under early exit)
                continue
            checked = min(k, a + 1)
            for j in range(checked):
                ok = j < a
                seen, hits = seen + 1, hits + ok
                for c, theta in zip(counts, self.thresholds):
                    if theta >= lowest and m[j] >= theta:
                        c[1] += 1
                        c[2] += ok
            stopped = len(m) > k and a == k  # every proposed draft accepted, then the rule stopped at an unsure one
            for c, theta in zip(counts, self.thresholds):
                if theta >= lowest:
                    c[0] += checked + (stopped and m[k] < theta)
        rows = self.by_threshold[d - 1]
        for row, c in zip(rows, counts):
            if c[0]:
                fade = self.memory / (self.memory + c[0])
                for i in range(3):
                    row[i] = fade * row[i] + c[i]
        if stop_margin is None and seen:
            fade = self.memory / (self.memory + seen)
            total = self.all[d - 1]
            total[0], total[1] = fade * total[0] + seen, fade * total[1] + hits

    def evidence(self, d: int) -> float:
        """(Faded) drafts seen at depth d by rounds that did not stop early."""
        return self.all[d - 1][0] if 1 <= d <= len(self.all) else 0.0

    def pass_rate(self, d: int, i: int) -> float:
        """s: the share of draft positions at depth d with margin ≥ thresholds[i]."""
        seen, sure, _ = self.by_threshold[d - 1][i]
        return sure / seen if seen > 0.0 else 0.0

    def relative_agreement(self, d: int, i: int) -> float:
        """a_θ ÷ the agreement of all drafts at depth d: how much likelier a draft the rule lets through is accepted.
        a_θ starts from the agreement of all drafts, counted as `prior_weight` drafts: a policy that takes the best of
        many (K, θ) would otherwise favour the threshold whose few drafts happened to be accepted (each estimate's
        noise, selected upwards)."""
        seen, hits = self.all[d - 1]
        if hits <= 0.0:
            return 1.0
        base = hits / seen
        _, sure, sure_hits = self.by_threshold[d - 1][i]
        w = self.prior_weight
        return ((sure_hits + w * base) / (sure + w)) / base if sure + w > 0.0 else 1.0
