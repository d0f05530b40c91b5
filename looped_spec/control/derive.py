"""Deriving a preset from the RFC's idealized cost model when it cannot be measured (no checkpoint / GPU).

Model (RFC, with the geometric acceptance expectation):

    T_plain = D · c(B)
    T_spec  = d(K+1) · c(B) + (D − d) · c(B(K+1))        c(N) = 1 + N / n_sat  (one loop step, N tokens)
    speedup = E(α_d, K) · T_plain / T_spec                E = (1 − α^{K+1}) / (1 − α)

`n_sat` is the token count at which a loop step costs twice a single-token step (memory-bound below it).
Workload difficulty h scales every depth's miss rate: 1 − α_d(h) = h · (1 − α_d). Sweeping h from easy
to hard, the best (K, d) at the bucket's representative batch traces a path from aggressive to
conservative (possibly ending at K=0): that path, reversed, is the bucket's candidate list, the best at
h = 1 is its initial candidate, and the thresholds are the expected accept rates ΣA/ΣK of a candidate at
the difficulties where it stops being the best (± `margin`), so the EMA policy moves exactly where the
model says the neighbour becomes better.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from looped_spec.control.goodput import expected_accept_rate, expected_tokens

DEFAULT_BUCKETS: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 4), (5, 12), (13, 32), (33, None))


def ideal_speedup(k: int, d: int, depth: int, batch: float, alpha: float, n_sat: float) -> float:
    """Predicted speedup over plain decoding of (K, d) at batch B (1.0 for K = 0)."""
    if k == 0:
        return 1.0

    def cost(n: float) -> float:
        return 1.0 + n / n_sat

    t_spec = d * (k + 1) * cost(batch) + (depth - d) * cost(batch * (k + 1))
    return expected_tokens(alpha, k) * depth * cost(batch) / t_spec


def _alpha(nominal: Sequence[float], d: int, h: float) -> float:
    return min(max(1.0 - h * (1.0 - nominal[d - 1]), 0.0), 1.0)


def best_candidate(
    depth: int, batch: float, nominal: Sequence[float], h: float, n_sat: float, max_k: int, depths: Sequence[int]
) -> tuple[int, int]:
    """(K, d) with the highest ideal speedup at difficulty h (K = 0 wins ties)."""
    best, best_s = (0, 0), 1.0
    for d in depths:
        for k in range(1, max_k + 1):
            s = ideal_speedup(k, d, depth, batch, _alpha(nominal, d, h), n_sat)
            if s > best_s * (1.0 + 1e-9):
                best, best_s = (k, d), s
    return best


def _crossing(depth: int, batch: float, nominal: Sequence[float], n_sat: float, low, high, h_range) -> float:
    """Difficulty where the more conservative `low` and the more aggressive `high` (K, d) are equally fast."""

    def gain(h: float) -> float:  # > 0 where `high` is better
        s_high = ideal_speedup(high[0], high[1], depth, batch, _alpha(nominal, high[1], h), n_sat)
        s_low = ideal_speedup(low[0], low[1], depth, batch, _alpha(nominal, low[1], h), n_sat) if low[0] else 1.0
        return s_high - s_low

    a, b = math.log(h_range[0]), math.log(h_range[1])
    for _ in range(60):
        mid = 0.5 * (a + b)
        a, b = (mid, b) if gain(math.exp(mid)) > 0 else (a, mid)
    return math.exp(0.5 * (a + b))


def derive_bucket(
    depth: int,
    batch: float,
    nominal: Sequence[float],
    n_sat: float,
    *,
    max_k: int = 6,
    depths: Sequence[int] | None = None,
    max_candidates: int = 5,
    margin: float = 0.03,
    h_range: tuple[float, float] = (0.25, 4.0),
    steps: int = 96,
) -> dict[str, Any]:
    """Candidates (conservative -> aggressive), initial index and per-candidate thresholds for one bucket.

    The path is cut to at most `max_candidates` around the nominal best (K=0 stays when on the path);
    thresholds come from the crossings of neighbours in the cut list.
    """
    depths = list(depths or range(1, depth))
    lo, hi = math.log(h_range[0]), math.log(h_range[1])
    path: list[tuple[int, int]] = []
    for i in range(steps):  # hard -> easy
        cand = best_candidate(depth, batch, nominal, math.exp(hi + (lo - hi) * i / (steps - 1)), n_sat, max_k, depths)
        if cand not in path:
            path.append(cand)
    nominal_best = best_candidate(depth, batch, nominal, 1.0, n_sat, max_k, depths)
    plain = [c for c in path if c[0] == 0]
    spec = [c for c in path if c[0] > 0]
    room = max_candidates - len(plain)
    if len(spec) > room:
        centre = spec.index(nominal_best) if nominal_best[0] > 0 else 0
        first = min(max(centre - room // 2, 0), len(spec) - room)
        spec = spec[first : first + room]
    path = plain + spec
    initial = path.index(nominal_best) if nominal_best in path else 0
    crossings = [_crossing(depth, batch, nominal, n_sat, path[i], path[i + 1], h_range) for i in range(len(path) - 1)]
    candidates: list[dict[str, Any]] = []
    for i, (k, d) in enumerate(path):
        entry: dict[str, Any] = {"k": k, "d": d}
        if k > 0:
            up = 1.0 if i + 1 == len(path) else expected_accept_rate(_alpha(nominal, d, crossings[i]), k) + margin
            down = 0.0 if i == 0 else expected_accept_rate(_alpha(nominal, d, crossings[i - 1]), k) - margin
            up, down = min(up, 1.0), max(down, 0.0)
            if down > up:
                up = down = (up + down) / 2
            entry.update(theta_up=round(up, 3), theta_down=round(down, 3))
        candidates.append(entry)
    return {"candidates": candidates, "initial_index": initial}


def derive_preset(
    model: str,
    depth: int,
    nominal: Sequence[float],
    n_sat: float,
    *,
    hardware: str = "any",
    buckets: Sequence[tuple[int, int | None]] = DEFAULT_BUCKETS,
    bucket_knobs: dict[str, Any] | None = None,
    disable: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
    **derive_options: Any,
) -> dict[str, Any]:
    """A whole preset (plain data for `AdaptiveSpecConfig.parse` / a JSON file)."""
    out_buckets = []
    for lo, hi in buckets:
        batch = math.sqrt(lo * hi) if hi is not None else 2.0 * lo
        data: dict[str, Any] = {"min_batch": lo, "max_batch": hi}
        data.update(derive_bucket(depth, batch, nominal, n_sat, **derive_options))
        data.update(bucket_knobs or {})
        out_buckets.append(data)
    return {
        "model": model,
        "hardware": hardware,
        "full_depth": depth,
        "depth_rule": "exact",
        "buckets": out_buckets,
        "disable": disable or {},
        "provenance": provenance or {},
    }
