"""Preset rules: from an acceptance model and a round-cost function to buckets, candidates and thresholds.

One set of rules serves both kinds of preset (docs/adaptive.md "Presets"):
- tuned presets (`looped-spec tune`): acceptance per depth measured by counterfactual readouts, round cost
  from the measured pass-cost profile (control/passcost.py);
- derived presets for models we cannot run here (`derive_preset`): the design's reported acceptance and its
  idealised pass cost, a pass over n positions 1 + n / n_sat units (`ideal_cost`).

Per bucket, at its representative batch size, every option (K, d) of the grid and plain decoding gets a
predicted speed E(K, d) / T(K, d) (E: expected committed tokens per request per round, the Markov
expectation of `acceptance.markov_tokens`). A workload of difficulty h scales every depth's miss rate,
α_d(h) = clamp(1 − h·(1 − α_d), 0, 1) (persistence unchanged). Sweeping h from hard to easy, the fastest
option traces a path from conservative (plain) to aggressive: that path is the bucket's candidate list, the
fastest at h = 1 (the measured acceptance) its initial candidate, and the thresholds θ are a candidate's
expected ΣA/ΣK at the difficulties where a neighbour becomes faster (± `margin`), so the EMA policy moves
exactly where the model says the neighbour wins. The goodput policy uses the same two models directly.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from looped_spec.control.acceptance import accept_rate, markov_tokens
from looped_spec.control.passcost import PassCost
from looped_spec.presets.schema import CostConfig

RULES = {
    "buckets": (
        "a batch size belongs to the profiled batch size nearest to it in log space (ties to the smaller): "
        "bucket i covers floor(sqrt(b[i-1]*b[i]))+1 .. floor(sqrt(b[i]*b[i+1])), the first starts at 1, the "
        "last is unbounded; each bucket is derived at its own profiled batch size b[i]"
    ),
    "speed": (
        "speed(K, d) = E(K, d) / T(K, d, b): E = expected committed tokens per request per round of the "
        "two-state Markov model of draft agreement (alpha_d, rho_d), T = predicted round seconds; plain: 1 / T_plain"
    ),
    "order": (
        "sweep the difficulty h (alpha_d(h) = clamp(1 - h(1 - alpha_d))) from hard (h where every alpha is 0, at "
        "most 64) to easy (1/16), 40 log-spaced points per decade; candidates = plain followed by the options in "
        "the order they first become the fastest; then the fastest option of every acceptance variant (the "
        "tuner's: alpha and rho of random batches of tuning prompts of the bucket's size, whose depths do not "
        "move together as h moves them), each placed at the h where it comes closest to the fastest; then every "
        "option predicted within `near` (6 %) of the fastest at an h within a factor 1.5 of 1 or at a variant, "
        "placed likewise; where no option is ever the fastest, the one fastest at the easiest h, placed likewise; at "
        "most `max_candidates` (10): the fastest at h = 1 and those that come closest to the fastest there, in order"
    ),
    "initial": "initial_index = the fastest option at h = 1 (the measured acceptance)",
    "thresholds": (
        "for neighbours (lower, upper), h_x = where the fastest option changes from lower to upper (bisection in "
        "log h); theta_up(lower) = lower's expected sum(A)/sum(K) at h_x + margin, theta_down(upper) = upper's at "
        "h_x - margin; the last candidate's theta_up is 1.0; clamped to [0, 1], theta_down <= theta_up; "
        "prior = the candidate's expected sum(A)/sum(K) at h = 1"
    ),
    "ema": (
        "per bucket, from the initial (else the first speculative) candidate's expected acceptance a, K and batch "
        "b: per-round noise s = sqrt(max(a(1-a), 0.05)/(b*K)); beta = 2x/(1+x) with x = (0.05/s)^2, clamped to "
        "[0.1, 0.5]; min_samples = max(4, ceil(1/beta)); interval = max(2, ceil(min_samples/2))"
    ),
    "disable": (
        "Phase 2 on, timing comparison off (acceptance decides); threshold = the smallest off threshold (first "
        "speculative candidate's theta_down) over the buckets; probe_base 16, probe_cap 256, probe_rounds 2, "
        "probe_evidence 32"
    ),
}

#: Options predicted within NEAR of the fastest (at a difficulty within a factor NEAR_BAND of the measured
#: acceptance, or at an acceptance variant) are candidates too: a profile a few percent off, or text a little
#: easier than the tuning prompts, reorders them (docs/adaptive.md "Presets").
NEAR = 0.06
NEAR_BAND = 1.5
H_EASY = 1.0 / 16.0
H_HARD_MAX = 64.0
POINTS_PER_DECADE = 40
DEFAULT_BUCKETS: tuple[tuple[int, int | None], ...] = ((1, 1), (2, 4), (5, 12), (13, 32), (33, None))


@dataclass
class BucketModel:
    """What the rules know about one bucket: acceptance per depth and round seconds at its batch size."""

    alpha: Sequence[float]  # [D] measured (or assumed) agreement of depth d with full depth
    rho: Sequence[float]  # [D] persistence of that agreement
    seconds: Callable[[int, int], float]  # (K, d) -> round seconds at this batch (K = 0: plain)
    # acceptance (alpha, rho per depth) of workloads the bucket may meet (e.g. random batches of tuning prompts):
    # their fastest options join the candidates
    variants: Sequence[tuple[Sequence[float], Sequence[float]]] = ()

    def alpha_at(self, d: int, h: float) -> float:
        return min(max(1.0 - h * (1.0 - self.alpha[d - 1]), 0.0), 1.0)

    def speed(self, option: tuple[int, int], h: float) -> float:
        k, d = option
        if k == 0:
            return 1.0 / self.seconds(0, 0)
        return float(markov_tokens(self.alpha_at(d, h), self.rho[d - 1], k)) / self.seconds(k, d)

    def accept_rate(self, option: tuple[int, int], h: float) -> float:
        k, d = option
        return float(accept_rate(self.alpha_at(d, h), self.rho[d - 1], k))

    def fastest(self, options: Sequence[tuple[int, int]], h: float) -> tuple[int, int]:
        """Fastest option at difficulty h (the earlier, i.e. more conservative, wins ties)."""
        best, best_speed = options[0], self.speed(options[0], h)
        for option in options[1:]:
            s = self.speed(option, h)
            if s > best_speed * (1.0 + 1e-9):
                best, best_speed = option, s
        return best


def _closest_h(model: BucketModel, option: tuple[int, int], fastest: dict[float, tuple[int, int]]) -> float:
    """The difficulty of the sweep (`fastest`: h -> fastest option there) where `option` comes closest to the
    fastest option (ties: the harder)."""
    return max(fastest, key=lambda h: (model.speed(option, h) / model.speed(fastest[h], h), h))


def _variant_winners(model: BucketModel, options, path) -> list[tuple[int, int]]:
    """Fastest option of each acceptance variant at h = 1 that the sweep's path does not have, in first-seen order."""
    out: list[tuple[int, int]] = []
    for alpha, rho in model.variants:
        variant = BucketModel(alpha, rho, model.seconds)
        option = variant.fastest(options, 1.0)
        if option not in path and option not in out:
            out.append(option)
    return out


def _closeness(
    model: BucketModel, options: Sequence[tuple[int, int]], fastest: dict[float, tuple[int, int]]
) -> dict[tuple[int, int], float]:
    """Per option, the highest ratio of its predicted speed to the fastest option's over the acceptances the
    measurements allow: the sweep's difficulties within a factor NEAR_BAND of h = 1 and every acceptance variant."""
    situations = [(model, h) for h in fastest if 1.0 / NEAR_BAND <= h <= NEAR_BAND]
    situations += [(BucketModel(alpha, rho, model.seconds), 1.0) for alpha, rho in model.variants]
    out = dict.fromkeys(options, 0.0)
    for m, h in situations:
        speeds = {o: m.speed(o, h) for o in options}
        top = max(speeds.values())
        for o, s in speeds.items():
            out[o] = max(out[o], s / top)
    return out


def _hardest(model: BucketModel, options: Sequence[tuple[int, int]]) -> float:
    misses = [1.0 - model.alpha[d - 1] for k, d in options if k > 0]
    smallest = min((m for m in misses if m > 0.0), default=1.0 / H_HARD_MAX)
    return min(max(1.0 / smallest, 1.0), H_HARD_MAX)


def _crossing(model: BucketModel, lower, upper, hard: float, easy: float) -> float:
    """Difficulty between `hard` and `easy` where `upper` becomes faster than `lower` (bisection in log h)."""
    a, b = math.log(hard), math.log(easy)
    for _ in range(50):
        mid = 0.5 * (a + b)
        a, b = (a, mid) if model.speed(upper, math.exp(mid)) > model.speed(lower, math.exp(mid)) else (mid, b)
    return math.exp(0.5 * (a + b))


def ema_knobs(acceptance: float, k: int, batch: float) -> dict[str, Any]:
    """beta, min_samples and interval for a bucket (RULES["ema"])."""
    noise = math.sqrt(max(acceptance * (1.0 - acceptance), 0.05) / (max(batch, 1.0) * max(k, 1)))
    x = (0.05 / noise) ** 2
    beta = min(max(2.0 * x / (1.0 + x), 0.1), 0.5)
    min_samples = max(4, math.ceil(1.0 / beta))
    return {"beta": round(beta, 3), "min_samples": min_samples, "interval": max(2, math.ceil(min_samples / 2))}


def derive_bucket(
    model: BucketModel,
    grid: Sequence[tuple[int, int]],
    batch: float,
    *,
    max_candidates: int = 10,
    margin: float = 0.03,
    near: float = NEAR,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(bucket data without min/max_batch, decision notes) for one bucket at batch size `batch`."""
    options = [(0, 0), *[tuple(c) for c in grid if c[0] > 0]]
    hard = _hardest(model, options)
    points = max(2, int(POINTS_PER_DECADE * math.log10(hard / H_EASY)) + 1)
    sweep = {math.exp(math.log(hard) + (math.log(H_EASY) - math.log(hard)) * i / (points - 1)) for i in range(points)}
    path: list[tuple[int, int]] = []
    first_h: dict[tuple[int, int], float] = {}
    # hard -> easy, through the measured acceptance (h = 1)
    fastest = {h: model.fastest(options, h) for h in sorted(sweep | {1.0}, reverse=True)}
    for h, option in fastest.items():
        if option not in path:
            path.append(option)
            first_h[option] = h
    for option in _variant_winners(model, options, path):  # placed where they come closest to winning
        first_h[option] = _closest_h(model, option, fastest)
        path.append(option)
    # options the measurements cannot tell from the fastest join too, so the online policy can find out
    closeness = _closeness(model, options, fastest)
    for option in sorted(options[1:], key=lambda o: -closeness[o]):
        if closeness[option] >= 1.0 - near and option not in path:
            first_h[option] = _closest_h(model, option, fastest)
            path.append(option)
    # plain first, at the hardest place; the rest by place (stable: the sweep's own order where the h ties)
    path = [(0, 0), *sorted((o for o in path if o != (0, 0)), key=lambda o: -first_h[o])]
    first_h[(0, 0)] = hard
    nominal = model.fastest(options, 1.0)  # the initial candidate
    spec = path[1:]
    if not spec and len(options) > 1:  # nothing ever beats plain: keep the option closest to it as the probe target,
        # placed where it comes closest (so its theta_down is its acceptance there, not at the hardest text's 0, which
        # would let the EMA policy's first probe switch speculation on for good)
        spec = [max(options[1:], key=lambda o: model.speed(o, H_EASY))]
        first_h[spec[0]] = _closest_h(model, spec[0], fastest)
    room = max_candidates - 1
    if len(spec) > room:  # keep those closest to the fastest near the measured acceptance, in their order; the
        # fastest at the measured acceptance always (options as close, placed nearer h = 1, would else drop it and
        # the bucket would start at plain where its rules predict speculation pays)
        ranked = sorted(spec, key=lambda o: (o != nominal, -closeness[o], abs(math.log(first_h[o]))))
        kept = set(ranked[:room])
        spec = [o for o in spec if o in kept]
    chain = [(0, 0), *spec]
    # neighbours change places between the difficulties where each was placed (for the sweep's own options
    # that bracket holds their crossing anyway; it keeps a variant's thresholds in order around its place)
    placed = [first_h.get(option, hard) for option in chain]
    crossings = [_crossing(model, chain[i], chain[i + 1], placed[i], placed[i + 1]) for i in range(len(chain) - 1)]
    candidates: list[dict[str, Any]] = [{"k": 0, "d": 0}]
    for i in range(1, len(chain)):
        option = chain[i]
        up = 1.0 if i + 1 == len(chain) else model.accept_rate(option, crossings[i]) + margin
        down = model.accept_rate(option, crossings[i - 1]) - margin
        up, down = round(min(max(up, 0.0), 1.0), 3), round(min(max(down, 0.0), 1.0), 3)
        prior = round(model.accept_rate(option, 1.0), 3)
        candidates.append({"k": option[0], "d": option[1], "theta_up": up, "theta_down": min(down, up), "prior": prior})
    initial = chain.index(nominal) if nominal in chain else 0
    ref = chain[initial] if initial else (chain[1] if len(chain) > 1 else (1, 1))
    knobs = ema_knobs(model.accept_rate(ref, 1.0) if ref[0] else 0.5, ref[0], batch)
    speeds = {f"{k},{d}": model.speed((k, d), 1.0) for k, d in options}
    plain = speeds["0,0"]
    notes = {
        "from_batch": batch,
        "chain": [f"{k},{d}" for k, d in chain],
        "initial": f"{nominal[0]},{nominal[1]}",
        "switch_h": [round(x, 4) for x in crossings],
        "predicted_ratio": {key: round(s / plain, 4) for key, s in speeds.items() if key != "0,0"},
    }
    return {"candidates": candidates, "initial_index": initial, **knobs}, notes


def bucket_ranges(batch_sizes: Sequence[int]) -> list[tuple[int, int | None]]:
    """Bucket (min, max) per batch size: each batch size owns the sizes nearest to it in log space."""
    sizes = sorted(set(batch_sizes))
    out: list[tuple[int, int | None]] = []
    lo = 1
    for i, b in enumerate(sizes):
        hi = None if i + 1 == len(sizes) else max(int(math.floor(math.sqrt(b * sizes[i + 1]))), lo)
        out.append((lo, hi))
        if hi is not None:
            lo = hi + 1
    return out


def derive_buckets(
    models: dict[int, BucketModel],
    grid: Sequence[tuple[int, int]],
    ranges: Sequence[tuple[int, int | None]] | None = None,
    **options: Any,
) -> tuple[list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """(buckets, disable settings, notes per bucket) from one `BucketModel` per representative batch size.

    Without `ranges`, buckets follow `bucket_ranges(models)`; with them, bucket i uses model i (sorted).
    """
    sizes = sorted(models)
    ranges = list(ranges) if ranges is not None else bucket_ranges(sizes)
    if len(ranges) != len(sizes):
        raise ValueError(f"{len(ranges)} bucket ranges for {len(sizes)} batch sizes")
    buckets, notes = [], {}
    for (lo, hi), batch in zip(ranges, sizes):
        data, note = derive_bucket(models[batch], grid, batch, **options)
        buckets.append({"min_batch": lo, "max_batch": hi, **data})
        notes[f"{lo}..{'inf' if hi is None else hi}"] = note
    offs = [b["candidates"][1]["theta_down"] for b in buckets if len(b["candidates"]) > 1]
    disable = {
        "enabled": True,
        "threshold": min(offs, default=0.25),
        "probe_base": 16,
        "probe_cap": 256,
        "probe_rounds": 2,
        "probe_evidence": 32,
    }
    return buckets, disable, notes


def pass_seconds(cost: PassCost, batch: float, context: float) -> Callable[[int, int], float]:
    """(K, d) -> predicted round seconds at `batch` and mean `context` from a pass-cost profile (each plan priced
    once: a bucket's derivation asks for the same few plans' prices tens of thousands of times)."""

    @functools.cache
    def seconds(k: int, d: int) -> float:
        return float(cost.profile_seconds([k], [d], round(batch), context)[0])

    return seconds


def ideal_cost(positions_at_saturation: float, readout_share: float = 0.08) -> dict:
    """A `CostConfig` for hardware we cannot time (the design's idealised model, docs/adaptive.md): a loop pass
    over n positions costs 1 + n / n_sat units (the block's weights read once, compute-bound past n_sat
    positions), a readout `readout_share` of that (a 1.4B Ouro's head is ~8 % of its block's weights)."""
    unit = 1e-3
    grid = [1, 4, 16, 64, 256, 1024]
    return {
        "positions": grid,
        "pass_seconds": [unit * (1.0 + n / positions_at_saturation) for n in grid],
        "request_seconds": 0.0,
        "request_context_seconds": 0.0,
        "query_context_seconds": 0.0,
        "step_seconds": [0.0, 0.0, 0.0],
        "embed_seconds": [0.0, 0.0],
        "readout_seconds": [unit * readout_share, unit * readout_share / positions_at_saturation],
        "round_seconds": [0.0, 0.0],
        "speculative_seconds": [0.0, 0.0, 0.0],
    }


def derive_preset(
    model: str,
    depth: int,
    nominal: Sequence[float],
    n_sat: float,
    *,
    hardware: str = "any",
    buckets: Sequence[tuple[int, int | None]] = DEFAULT_BUCKETS,
    max_k: int = 6,
    bucket_knobs: dict[str, Any] | None = None,
    disable: dict[str, Any] | None = None,
    provenance: dict[str, Any] | None = None,
    model_type: str | None = None,
    **derive_options: Any,
) -> dict[str, Any]:
    """A whole preset (plain data for `AdaptiveSpecConfig.parse`) from assumed acceptance and the ideal cost.

    Each bucket is derived at its geometric-mean batch size (2·min for the unbounded last one); the
    assumed acceptance goes into the preset's `acceptance` section (persistence 0, positions 0 = assumed).
    The cost is the design's idealised pass profile (`ideal_cost`: a pass costs 1 + n / n_sat units);
    the lists stay at 8 without the options merely near the fastest (`near` 0) unless asked.
    """
    derive_options = {"near": 0.0, "max_candidates": 8, **derive_options}
    rho = [0.0] * depth
    grid = [(k, d) for k in range(1, max_k + 1) for d in range(1, depth)]
    models = {}
    cost_data = ideal_cost(n_sat)
    cost = PassCost(CostConfig.model_validate(cost_data), depth)
    for lo, hi in buckets:
        batch = math.sqrt(lo * hi) if hi is not None else 2.0 * lo
        models[batch] = BucketModel(nominal, rho, pass_seconds(cost, batch, 0.0))
    out_buckets, rule_disable, _ = derive_buckets(models, grid, list(buckets), **derive_options)
    for b in out_buckets:
        b.update(bucket_knobs or {})
    return {
        "model": model,
        "model_type": model_type,
        "hardware": hardware,
        "full_depth": depth,
        "buckets": out_buckets,
        "disable": {**rule_disable, **(disable or {})},
        "acceptance": {"alpha": [round(a, 4) for a in nominal], "rho": rho, "positions": 0},
        "cost": cost_data,
        "provenance": provenance or {},
    }
