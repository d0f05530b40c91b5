"""Tuner rules: from measured (K, d) cells to a preset's buckets, candidate order, thresholds and EMA knobs.

The rule texts below are written into the preset's provenance verbatim.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

from looped_spec.control.goodput import expected_accept_rate, expected_tokens

BUCKET_RULE = (
    "a batch size belongs to the measured batch size nearest to it in log space (ties to the smaller): "
    "bucket i covers floor(sqrt(b[i-1]*b[i]))+1 .. floor(sqrt(b[i]*b[i+1])), the first starts at 1, the last "
    "is unbounded; each bucket is tuned from its own measured batch size b[i]"
)
RATIO_RULE = (
    "ratio = decode tokens/s of (K, d) / decode tokens/s of plain decoding on the same adapter and prompts, "
    "decode time = generate() wall time minus the engine's prefill phase time, decode tokens = generated "
    "tokens minus one per request; screen: one run per cell, plain timed before and after the cells (mean); "
    "confirm: `repeats` rounds of plain then every top cell, median of the per-round ratios"
)
ORDER_RULE = (
    "sweep the workload difficulty h (model below) from hard (max(16, the h where every cell's alpha(h) = 0)) "
    "to easy (1/16), 40 log-spaced points per decade; "
    "the chain is K=0 followed by the confirmed cells in the order they first become the fastest option "
    "(plain included; ties go to the earlier); confirmed cells that are never the fastest are dropped "
    "(listed in decisions); if no cell ever beats plain, the best-ratio cell is kept as the probe target"
)
MODEL_RULE = (
    "alpha_d = per-token acceptance of a depth-d draft: every screened and confirmed cell of depth d at the "
    "bucket's batch size has its sum(A)/sum(K) inverted under geometric acceptance ((E(alpha,K)-1)/K, "
    "E = (1-alpha^(K+1))/(1-alpha)), averaged weighted by drafted tokens, capped at 0.995; per cell: round "
    "cost c = E(alpha_d,K)/ratio (plain-step units, so the model reproduces the measured ratio at h=1); a "
    "workload of difficulty h scales the miss rate: alpha_d(h) = clamp(1 - h*(1-alpha_d), 0, 1); modelled "
    "speedup(h) = E(alpha_d(h),K)/c, plain = 1"
)
THRESHOLD_RULE = (
    "for neighbours (lower, upper) of the chain, h_x = the difficulty where the sweep's fastest option changes "
    "from lower to upper (bisection in log h; the hard end if upper is fastest from the start, 1/16 for a kept "
    "probe target); theta_up(lower) = lower's expected sum(A)/sum(K) at h_x + margin, theta_down(upper) = upper's "
    "at h_x - margin, so the first speculative cell's theta_down is its break-even with plain (the off "
    "threshold); the last cell's theta_up is 1.0; clamped to [0, 1], theta_down <= theta_up; prior = the "
    "measured acceptance"
)
INITIAL_RULE = (
    "initial_index = the confirmed cell with the highest median ratio when that ratio >= 1 + min_gain, "
    "else 0 (K=0: the bucket starts plain and probes the first speculative cell with backoff)"
)
EMA_RULE = (
    "per bucket, from the initial (else the first speculative) cell's measured acceptance a, K and batch b: "
    "per-round noise s = sqrt(max(a(1-a), 0.05)/(b*K)); beta = 2x/(1+x) with x = (0.05/s)^2 (EMA noise "
    "std 0.05), clamped to [0.1, 0.5]; min_samples = max(4, ceil(1/beta)); interval = max(2, "
    "ceil(min_samples/2)) (the floors keep cold-start and timing outliers from deciding alone)"
)
DISABLE_RULE = (
    "Phase 2 on (timing comparison on); threshold = the smallest off threshold (first speculative cell's "
    "theta_down) over the buckets, so it never overrides a bucket's own; probe_base 16, probe_cap 256, "
    "probe_rounds 2"
)
RULES = {
    "buckets": BUCKET_RULE,
    "ratio": RATIO_RULE,
    "order": ORDER_RULE,
    "model": MODEL_RULE,
    "thresholds": THRESHOLD_RULE,
    "initial": INITIAL_RULE,
    "ema": EMA_RULE,
    "disable": DISABLE_RULE,
}

H_LO = 1.0 / 16.0  # easiest difficulty swept: miss rates divided by 16
_POINTS_PER_DECADE = 40


def bucket_ranges(batch_sizes: Sequence[int]) -> list[tuple[int, int | None]]:
    """Batch-size ranges of the buckets, one per measured batch size (`BUCKET_RULE`)."""
    sizes = sorted(set(batch_sizes))
    ranges: list[tuple[int, int | None]] = []
    lo = 1
    for i, b in enumerate(sizes):
        if i + 1 == len(sizes):
            ranges.append((lo, None))
        else:
            hi = max(b, min(math.isqrt(b * sizes[i + 1]), sizes[i + 1] - 1))
            ranges.append((lo, hi))
            lo = hi + 1
    return ranges


def invert_accept_rate(rate: float, k: int) -> float:
    """Per-token acceptance alpha whose expected sum(A)/sum(K) over K drafts equals `rate` (geometric model)."""
    rate = min(max(rate, 0.0), 1.0)
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = 0.5 * (lo + hi)
        lo, hi = (mid, hi) if expected_accept_rate(mid, k) < rate else (lo, mid)
    return 0.5 * (lo + hi)


@dataclass(frozen=True)
class CellModel:
    """One measured (K, d) cell as the difficulty model sees it (`MODEL_RULE`); K=0 is plain decoding."""

    k: int
    d: int
    ratio: float = 1.0
    acceptance: float = 0.0
    depth_alpha: float | None = None
    """Pooled per-token acceptance of depth d (`depth_alphas`); None: from this cell's own acceptance."""

    @cached_property
    def alpha(self) -> float:
        if not self.k:
            return 0.0
        alpha = self.depth_alpha if self.depth_alpha is not None else invert_accept_rate(self.acceptance, self.k)
        return min(alpha, 0.995)

    @cached_property
    def cost(self) -> float:
        """Round time in plain-step units, such that speedup(1) equals the measured ratio."""
        return expected_tokens(self.alpha, self.k) / max(self.ratio, 1e-9) if self.k else 1.0

    def alpha_at(self, h: float) -> float:
        return min(max(1.0 - h * (1.0 - self.alpha), 0.0), 1.0)

    def speedup(self, h: float) -> float:
        return expected_tokens(self.alpha_at(h), self.k) / self.cost if self.k else 1.0

    def accept_rate(self, h: float) -> float:
        return expected_accept_rate(self.alpha_at(h), self.k)


def depth_alphas(cells: Sequence[dict[str, Any]]) -> dict[int, float]:
    """Per-token acceptance per draft depth, pooled over measured cells (`MODEL_RULE`).

    Each item has k, d, acceptance and optionally proposed (its drafted tokens, the weight; default 1).
    """
    sums: dict[int, list[float]] = {}
    for c in cells:
        weight = float(c.get("proposed", 1) or 0)
        if c["k"] > 0 and weight > 0:
            acc = sums.setdefault(c["d"], [0.0, 0.0])
            acc[0] += weight * invert_accept_rate(c["acceptance"], c["k"])
            acc[1] += weight
    return {d: a / w for d, (a, w) in sums.items()}


def hardest(cells: Sequence[CellModel]) -> float:
    """Hard end of the sweep: where every cell's drafts are always rejected (alpha(h) = 0), at least 16."""
    return max([16.0] + [1.0 / (1.0 - c.alpha) for c in cells if c.k])


def _sweep(h_hi: float) -> list[float]:
    """Difficulties from hardest (`h_hi`) to easiest (H_LO), evenly spaced in log h, plus the measured h = 1."""
    n = max(2, math.ceil(math.log10(h_hi / H_LO) * _POINTS_PER_DECADE) + 1)
    return sorted({h_hi * (H_LO / h_hi) ** (i / (n - 1)) for i in range(n)} | {1.0}, reverse=True)


def _winner(options: Sequence[CellModel], h: float) -> int:
    """Index of the fastest option at difficulty h (the earlier, more conservative one wins ties)."""
    best = 0
    for i in range(1, len(options)):
        if options[i].speedup(h) > options[best].speedup(h) * (1.0 + 1e-9):
            best = i
    return best


def winner_path(cells: Sequence[CellModel]) -> tuple[list[CellModel], list[float]]:
    """K=0 and the cells that are fastest somewhere on the hard -> easy sweep, in order (`ORDER_RULE`).

    Returns the chain and, for each neighbour pair, the difficulty where the faster one changes.
    """
    options = [CellModel(0, 0), *cells]
    sweep = _sweep(hardest(cells))
    path, switches = [0], []
    for i, h in enumerate(sweep):
        w = _winner(options, h)
        if w not in path:
            lower = options[path[-1]]
            switches.append(_bisect(lower, options[w], sweep[i - 1], h) if i else sweep[0])
            path.append(w)
    return [options[i] for i in path], switches


def _bisect(lower: CellModel, upper: CellModel, hard: float, easy: float) -> float:
    """Difficulty between `hard` and `easy` where `upper` starts to beat `lower` (log-space bisection)."""
    a, b = math.log(easy), math.log(hard)  # upper wins at a
    for _ in range(40):
        mid = 0.5 * (a + b)
        if upper.speedup(math.exp(mid)) > lower.speedup(math.exp(mid)):
            a = mid
        else:
            b = mid
    return math.exp(0.5 * (a + b))


def break_even(cell: CellModel) -> float:
    """Hardest difficulty at which `cell` still beats plain decoding (H_LO if nowhere, the hard end if always)."""
    sweep = _sweep(hardest([cell]))
    plain = CellModel(0, 0)
    for i, h in enumerate(sweep):
        if cell.speedup(h) > 1.0:
            return _bisect(plain, cell, sweep[i - 1], h) if i else sweep[0]
    return H_LO


def ema_knobs(acceptance: float, k: int, batch: int) -> dict[str, Any]:
    """beta, min_samples and interval for a bucket (`EMA_RULE`)."""
    noise = math.sqrt(max(acceptance * (1.0 - acceptance), 0.05) / (batch * max(k, 1)))
    x = (0.05 / noise) ** 2
    beta = min(max(2.0 * x / (1.0 + x), 0.1), 0.5)
    min_samples = max(4, math.ceil(1.0 / beta))
    return {"beta": round(beta, 3), "min_samples": min_samples, "interval": max(2, math.ceil(min_samples / 2))}


def build_bucket(
    lo: int,
    hi: int | None,
    batch: int,
    confirmed: dict[str, dict],
    screened: dict[str, dict] | None = None,
    *,
    margin: float,
    min_gain: float,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One preset bucket from the cells measured at its batch size; returns (bucket, decision notes).

    `confirmed` cells ({"K,d": {"ratio", "acceptance", "proposed"?}}) are the candidates; their and the
    `screened` cells' acceptance give the per-depth alpha.
    """
    measured = [(key, c) for source in (screened or {}, confirmed) for key, c in source.items()]
    alphas = depth_alphas([{"k": cell_key(key)[0], "d": cell_key(key)[1], **c} for key, c in measured])
    cells = [
        CellModel(
            *cell_key(key), ratio=c["ratio"], acceptance=c["acceptance"], depth_alpha=alphas.get(cell_key(key)[1])
        )
        for key, c in confirmed.items()
    ]
    chain, switches = winner_path(cells)
    best = max(cells, key=lambda c: c.ratio, default=None)
    if len(chain) == 1 and best is not None:  # nothing ever beats plain: keep the best cell as the probe target
        chain.append(best)
        switches.append(H_LO)
    candidates: list[dict[str, Any]] = [{"k": 0, "d": 0}]
    for i in range(1, len(chain)):
        cell = chain[i]
        up = 1.0 if i + 1 == len(chain) else cell.accept_rate(switches[i]) + margin
        down = cell.accept_rate(switches[i - 1]) - margin
        up, down = round(min(max(up, 0.0), 1.0), 3), round(min(max(down, 0.0), 1.0), 3)
        down = min(down, up)
        prior = round(min(max(cell.acceptance, 0.0), 1.0), 3)
        candidates.append({"k": cell.k, "d": cell.d, "theta_up": up, "theta_down": down, "prior": prior})
    initial = 0
    if best is not None and best.ratio >= 1.0 + min_gain and best in chain:
        initial = chain.index(best)
    ordered = chain[1:]
    ref = ordered[initial - 1] if initial else (ordered[0] if ordered else None)
    knobs = ema_knobs(ref.acceptance, ref.k, batch) if ref else ema_knobs(0.5, 1, batch)
    bucket = {"min_batch": lo, "max_batch": hi, "candidates": candidates, "initial_index": initial, **knobs}
    notes = {
        "from_batch": batch,
        "chain": [f"{c.k},{c.d}" for c in chain],
        "dropped": [f"{c.k},{c.d}" for c in cells if c not in chain],
        "initial": f"{candidates[initial]['k']},{candidates[initial]['d']}",
        "switch_h": [round(x, 4) for x in switches],
        "break_even_h": [round(break_even(c), 4) for c in ordered],
        "modelled_cost": [round(c.cost, 4) for c in ordered],
        "depth_alpha": {str(d): round(a, 4) for d, a in sorted(alphas.items())},
    }
    return bucket, notes


def build_preset(
    model: str,
    depth: int,
    hardware: str,
    measurements: dict[int, dict[str, Any]],
    *,
    margin: float = 0.03,
    min_gain: float = 0.02,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Preset data (for `AdaptiveSpecConfig.parse`) and per-bucket decision notes from the measurements."""
    buckets, notes = [], {}
    for (lo, hi), batch in zip(bucket_ranges(list(measurements)), sorted(measurements)):
        m = measurements[batch]
        bucket, note = build_bucket(
            lo, hi, batch, m["confirm"]["cells"], m["screen"]["cells"], margin=margin, min_gain=min_gain
        )
        buckets.append(bucket)
        notes[f"{lo}..{'inf' if hi is None else hi}"] = note
    offs = [b["candidates"][1]["theta_down"] for b in buckets if len(b["candidates"]) > 1]
    disable = {
        "enabled": True,
        "threshold": min(offs, default=0.25),
        "probe_base": 16,
        "probe_cap": 256,
        "probe_rounds": 2,
        "use_timing": True,
    }
    data = {
        "model": model,
        "hardware": hardware,
        "full_depth": depth,
        "depth_rule": "exact",
        "buckets": buckets,
        "disable": disable,
    }
    return data, notes


def cell_key(key: str) -> tuple[int, int]:
    """ "K,d" -> (K, d)."""
    k, d = key.split(",")
    return int(k), int(d)
