"""A preset's buckets with per-candidate values resolved into plain lists for the per-round hot path."""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass

from looped_spec.control.schema import AdaptiveSpecConfig, BucketConfig


@dataclass(slots=True)
class CompiledBucket:
    """One preset bucket (`config`, as written) with its per-candidate values resolved for the hot path.

    The candidate lists are parallel, indexed like ``config.candidates``; the bucket's own settings (beta,
    min_samples, ...) are read from `config`.
    """

    config: BucketConfig
    ks: list[int]  # [C] draft tokens per candidate (0: plain decoding)
    ds: list[int]  # [C] draft depth per candidate (0 for k == 0)
    theta_up: list[float]  # [C] the candidate's, else the bucket's (1.0 for k == 0)
    theta_down: list[float]  # [C] the candidate's, else the bucket's (0.0 for k == 0)
    prior: list[float | None]  # [C] initial EMA or None
    has_plain: bool  # candidate 0 is k == 0
    lowest_spec: int  # index of the most conservative speculative candidate, -1 if none
    off_threshold: float  # acceptance EMA of `lowest_spec` below which the bucket goes plain; -1: never

    @property
    def plain_candidate(self) -> int:
        """Candidate index a plain plan carries: 0 when the list starts with K=0, else -1 (Phase 2 off)."""
        return 0 if self.has_plain else -1

    def label(self) -> str:
        hi = self.config.max_batch
        return f"{self.config.min_batch}..{'inf' if hi is None else hi}"


def compile_buckets(config: AdaptiveSpecConfig) -> list[CompiledBucket]:
    """Resolve a (depth-checked) preset's buckets; the off threshold is the larger of the two routes to plain.

    Routes: a K=0 first candidate (the list move down from `lowest_spec`, at its theta_down) and Phase 2
    (`disable.threshold`, when enabled).
    """
    out = []
    for b in config.buckets:
        ks = [c.k for c in b.candidates]
        ups = [1.0 if c.k == 0 else c.theta_up if c.theta_up is not None else b.theta_up for c in b.candidates]
        downs = [0.0 if c.k == 0 else c.theta_down if c.theta_down is not None else b.theta_down for c in b.candidates]
        has_plain = ks[0] == 0
        lowest = next((j for j, k in enumerate(ks) if k > 0), -1)
        routes = []
        if lowest >= 0 and has_plain:
            routes.append(float(downs[lowest]))
        if lowest >= 0 and config.disable.enabled:
            routes.append(config.disable.threshold)
        out.append(
            CompiledBucket(
                config=b,
                ks=ks,
                ds=[c.d if c.k > 0 else 0 for c in b.candidates],
                theta_up=[float(x) for x in ups],
                theta_down=[float(x) for x in downs],
                prior=[c.prior for c in b.candidates],
                has_plain=has_plain,
                lowest_spec=lowest,
                off_threshold=max(routes) if routes else -1.0,
            )
        )
    return out


class BucketTable:
    """Batch size -> bucket index by binary search over the buckets' upper bounds."""

    __slots__ = ("_upper", "_lower", "_sticky")

    def __init__(self, buckets: list[CompiledBucket]) -> None:
        self._upper = [b.config.max_batch for b in buckets[:-1]]  # validated: all but the last are bounded
        self._lower = [b.config.min_batch for b in buckets]
        self._sticky: tuple[int, float, float, float] = (-1, 0.0, 0.0, 0.0)  # (bucket, factor, low, high) last used

    def lookup(self, batch_size: int) -> int:
        """Bucket index for `batch_size` (values < 1 count as 1)."""
        return bisect_left(self._upper, batch_size)

    def lookup_sticky(self, batch_size: int, current: int, factor: float) -> int:
        """`current` while `batch_size` lies within its range widened by `factor` (and ±1), else `lookup`."""
        if 0 <= current < len(self._lower):
            cached, cached_factor, low, high = self._sticky
            if cached != current or cached_factor != factor:  # once per bucket change: plan() runs every round
                low = min(self._lower[current] - 1, self._lower[current] / factor)
                upper = self._upper[current] if current < len(self._upper) else None
                high = float("inf") if upper is None else max(upper + 1, upper * factor)
                self._sticky = (current, factor, low, high)
            if low <= batch_size <= high:
                return current
        return self.lookup(batch_size)
