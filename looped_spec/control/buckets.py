"""A preset's buckets resolved into plain lists for the per-round path, and batch size -> bucket lookup."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from looped_spec.presets.schema import AdaptiveSpecConfig, BucketConfig


@dataclass(slots=True)
class CompiledBucket:
    """One bucket (`config`, as written) with per-candidate values resolved, indexed like its candidates."""

    config: BucketConfig
    ks: list[int]  # [C] draft tokens (0: plain decoding)
    ds: list[int]  # [C] draft depth (0 with k = 0)
    theta_up: list[float]  # [C] the candidate's, else the bucket's (1.0 for k = 0)
    theta_down: list[float]  # [C] the candidate's, else the bucket's (0.0 for k = 0)
    prior: list[float | None]  # [C] initial acceptance EMA
    lowest_spec: int  # the most conservative speculative candidate, -1 if none
    off_threshold: float  # EMA policy: acceptance of `lowest_spec` below which it goes plain; -1: never
    # [O] (k, d) the goodput policy prices: the candidates, with plain decoding first when the list has no K = 0
    # candidate and speculation may be switched off (`disable.enabled`)
    options: list[tuple[int, int]]

    @property
    def may_run_plain(self) -> bool:
        return self.options[0][0] == 0

    @property
    def plain_candidate(self) -> int:
        """Candidate index a plain plan carries: 0 when the list starts with K=0, else -1."""
        return 0 if self.ks[0] == 0 else -1

    def label(self) -> str:
        hi = self.config.max_batch
        return f"{self.config.min_batch}..{'inf' if hi is None else hi}"


def compile_buckets(config: AdaptiveSpecConfig) -> list[CompiledBucket]:
    """Resolve every bucket; the EMA policy's off threshold is the larger of its two routes to plain (a K=0
    first candidate, left at `lowest_spec`'s theta_down, and `disable.threshold` when enabled)."""
    out = []
    for b in config.buckets:
        cands = b.candidates
        ks, ds = [c.k for c in cands], [c.d if c.k > 0 else 0 for c in cands]
        ups = [float(1.0 if c.k == 0 else b.theta_up if c.theta_up is None else c.theta_up) for c in cands]
        downs = [float(0.0 if c.k == 0 else b.theta_down if c.theta_down is None else c.theta_down) for c in cands]
        lowest = next((j for j, k in enumerate(ks) if k > 0), -1)
        routes = []
        if lowest >= 0 and ks[0] == 0:
            routes.append(downs[lowest])
        if lowest >= 0 and config.disable.enabled:
            routes.append(config.disable.threshold)
        options = list(zip(ks, ds))
        if ks[0] != 0 and config.disable.enabled:
            options.insert(0, (0, 0))
        priors = [c.prior for c in cands]
        out.append(CompiledBucket(b, ks, ds, ups, downs, priors, lowest, max(routes, default=-1.0), options))
    return out


class BucketTable:
    """Batch size -> bucket index, with hysteresis at the edges."""

    __slots__ = ("_upper", "_lower", "stickiness")

    def __init__(self, buckets: list[CompiledBucket], stickiness: float) -> None:
        self._upper = [b.config.max_batch for b in buckets[:-1]]  # validated: all but the last are bounded
        self._lower = [b.config.min_batch for b in buckets]
        self.stickiness = stickiness

    def lookup(self, batch_size: int) -> int:
        """Bucket index of `batch_size` (values < 1 count as 1)."""
        return bisect_left(self._upper, batch_size)

    def lookup_sticky(self, batch_size: int, current: int) -> int:
        """`current` while `batch_size` lies within its range widened by the stickiness factor (and ±1), so a
        batch hovering at an edge does not flip buckets every round; else `lookup`."""
        if 0 <= current < len(self._lower):
            low = min(self._lower[current] - 1, self._lower[current] / self.stickiness)
            upper = self._upper[current] if current < len(self._upper) else None
            high = float("inf") if upper is None else max(upper + 1, upper * self.stickiness)
            if low <= batch_size <= high:
                return current
        return self.lookup(batch_size)
