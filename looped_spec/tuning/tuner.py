"""Offline tuner: measure acceptance (model + text) and round cost (hardware) apart, derive a preset from both.

    looped-spec tune --model tiny-ouro --batch-sizes 1,2,4,8,16,32 --prompts tune --out presets/tiny-ouro.json

1. Acceptance (deterministic, no timing): every tuning prompt is decoded greedily alone with plain decoding
   while every round reads out all shallower depths (counterfactual readouts). That gives, per depth d and
   generated position, whether a depth-d draft would have proposed the token full depth committed. From
   those bits: α_d, persistence ρ_d, and the exact committed tokens per round of every (K, d) replayed on
   the real trajectories (`acceptance.simulate_tokens`), printed beside the Markov model's prediction.
2. Cost (hardware): for every profiled batch size, plain and every grid cell decode a fresh batch of tuning
   prompts for `profile_tokens` generated tokens per request, every round timed, on persistent engines,
   configurations interleaved in a shuffled order per repeat, the first repeat discarded. Timing the same
   stretch of generation prices plain and speculative rounds at the same contexts (a round's cost grows with
   the context). Plain decoding is the reference every plan is compared with, and this machine's speed drifts
   by ±20 % within seconds, so plain runs are spread through every repeat (one before the first cell and one
   after every `PLAIN_EVERY` cells) and each cell run is drift-corrected by the plain runs on either side of
   it (`drift_correct`). A configuration's cost is the median over repeats of its runs' trimmed mean round
   time (spread = (largest − smallest) / smallest), made non-decreasing in the batch size (a bigger batch
   never costs less per round), then fitted by the round-cost model of `costprofile.py`. Every timed round
   also records the batch's mean context, and per batch size and configuration round seconds are fitted as a
   line in it (Theil–Sen slope, median intercept over the runs; `context_lines`), so the profile also
   predicts at contexts other than the tuning runs' own (`CostProfile.predict(..., context=)`).
3. Preset: buckets, candidates, initial choices and thresholds from 1 + 2 (`control/derive.py`), plus both
   measurements (`acceptance`, `cost` sections) for the goodput policy, provenance with the tuning prompts'
   fingerprints (the benchmark refuses to evaluate on them). Given a cost profile (`cost_profile=`) the
   tuner times nothing and is deterministic.
"""

from __future__ import annotations

import random
import statistics
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, NamedTuple

from looped_spec.control.acceptance import bit_statistics, markov_tokens, prompt_spread, simulate_tokens
from looped_spec.control.costprofile import CONTEXT_FIELDS, CostProfile, nondecreasing
from looped_spec.control.presets import AdaptiveSpecConfig
from looped_spec.engine.config import SpeculativeConfig
from looped_spec.engine.engine import LoopedSpecEngine
from looped_spec.engine.inputs import load_tokenizer, to_token_ids
from looped_spec.models.adapter import ModelAdapter, load_adapter
from looped_spec.request import mean_context
from looped_spec.sampling_params import SamplingParams
from looped_spec.tuning.derive import RULES, BucketModel, bucket_ranges, derive_buckets
from looped_spec.tuning.inputs import (
    TunerError,
    hardware_tag,
    load_prompts,
    machine_info,
    parse_batch_sizes,
    parse_grid,
    prompt_fingerprints,
)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="tune", disable=not enabled, dynamic_ncols=True)


# ----------------------------------------------------------------------------------------- acceptance
def measure_match_bits(adapter: ModelAdapter, prompts: Sequence[Any], tokens: int, bar=None) -> list[list[list[int]]]:
    """bits[d-1][prompt][t]: did depth d's readout predict generated token t+1 (greedy, full-depth trajectory)."""
    depth = adapter.full_depth
    engine = LoopedSpecEngine(adapter, speculation=SpeculativeConfig(k=0, measure_depths=True), max_batch_size=1)
    rounds: list[list[int]] = []
    observe = engine.controller.observe

    def record(feedback) -> None:
        if feedback.depth_trials:
            rounds.append(list(feedback.depth_matches))
        observe(feedback)

    engine.controller.observe = record
    bits: list[list[list[int]]] = [[] for _ in range(depth)]
    params = SamplingParams(max_tokens=tokens, ignore_eos=True)
    for prompt in prompts:
        rounds.clear()
        engine.generate([prompt], params)
        for d in range(depth):
            bits[d].append([r[d] for r in rounds])
        if bar is not None:
            bar.update(1)
    engine.close()
    return bits


def acceptance_report(bits: list[list[list[int]]], grid: Sequence[tuple[int, int]]) -> dict[str, Any]:
    """α, ρ per depth and, per grid cell, committed tokens per round replayed on the bits vs the Markov model."""
    stats = [bit_statistics(b) for b in bits]
    cells = {}
    for k, d in grid:
        tokens, rounds = simulate_tokens(bits[d - 1], k)
        alpha, rho, _ = stats[d - 1]
        cells[f"{k},{d}"] = {
            "replayed_tokens_per_round": round(tokens / rounds, 4) if rounds else 0.0,
            "markov_tokens_per_round": round(markov_tokens(alpha, rho, k), 4),
        }
    return {
        "alpha": [round(s[0], 4) for s in stats],
        "rho": [round(s[1], 4) for s in stats],
        "spread": [round(min(prompt_spread(b), 0.5), 4) for b in bits],
        "positions": stats[0][2] if stats else 0,
        "cells": cells,
    }


#: Random batches of tuning prompts per bucket whose acceptance offers its fastest plan as a candidate.
VARIANTS = 32


def acceptance_variants(
    bits: list[list[list[int]]], batch: int, count: int = VARIANTS, seed: int = 0
) -> list[tuple[list[float], list[float]]]:
    """(alpha, rho per depth) of `count` random batches of `batch` tuning prompts (seeded; none when the batch
    takes every prompt). Text moves the depths' agreement unevenly (a prompt can be easy for depth 1 and not
    for depth 3), which the difficulty sweep of `control/derive.py` (one factor for every depth) cannot show;
    the fastest plan of each such batch becomes a candidate (RULES["order"])."""
    num = len(bits[0]) if bits else 0
    if batch >= num:
        return []
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        chosen = rng.sample(range(num), batch)
        stats = [bit_statistics([depth_bits[i] for i in chosen]) for depth_bits in bits]
        out.append(([s[0] for s in stats], [s[1] for s in stats]))
    return out


# ----------------------------------------------------------------------------------------- cost
class TimedRound(NamedTuple):
    """One timed decode round: wall seconds and the batch's mean context (KV tokens per request) at its start."""

    seconds: float
    context: float


#: Timed rounds per (batch size, configuration), one list per kept run.
Samples = dict[int, dict[tuple[int, int], list[list[TimedRound]]]]


class RoundTimer:
    """Times the decode rounds of one persistent engine per configuration over a decode horizon."""

    def __init__(self, adapter: ModelAdapter, max_batch: int, max_model_len: int, warmup: list[Any]) -> None:
        self.adapter, self.max_batch, self.max_model_len, self.warmup = adapter, max_batch, max_model_len, warmup
        self.engines: dict[tuple[int, int], LoopedSpecEngine] = {}

    def engine(self, cell: tuple[int, int]) -> LoopedSpecEngine:
        if cell not in self.engines:
            spec = "off" if cell[0] == 0 else SpeculativeConfig(k=cell[0], d=cell[1])
            engine = LoopedSpecEngine(
                self.adapter, speculation=spec, max_batch_size=self.max_batch, max_model_len=self.max_model_len
            )
            engine.generate(self.warmup, SamplingParams(max_tokens=4, ignore_eos=True))
            self.engines[cell] = engine
        return self.engines[cell]

    def time_rounds(self, cell: tuple[int, int], prompts: list[Any], horizon: int) -> list[TimedRound]:
        """Every decode round of a fresh batch until its requests have `horizon` tokens on average, timed.

        Round cost grows with the context (every loop pass reads the whole KV of every request), and a plain
        round moves the context one token while a speculative one moves it by its committed tokens. Timing
        every round over the same stretch of generated tokens prices plain and speculative rounds at the same
        contexts, the ones a `horizon`-token generation goes through. Every timed round is full-shape (every
        request drafts K: max_tokens leaves room), so the rounds are the plan's own shape. Each round comes with
        the batch's mean context at its start, which the context-aware profile is fitted against.
        """
        engine = self.engine(cell)
        k = cell[0]
        params = SamplingParams(max_tokens=2 * horizon + k + 2, ignore_eos=True)
        requests = [engine._requests[engine.add_request(p, params)] for p in prompts]
        stats = engine.stats
        while any(not r.prefilled for r in requests):
            engine.step()
        rounds: list[TimedRound] = []
        while sum(len(r.output_token_ids) for r in requests) < horizon * len(requests):
            r0, k0 = stats.num_rounds, stats.num_draft_tokens
            context = mean_context(requests)
            start = time.perf_counter()
            engine.step()
            elapsed = time.perf_counter() - start
            if stats.num_rounds == r0 + 1 and stats.num_draft_tokens - k0 == k * len(prompts):
                rounds.append(TimedRound(elapsed, context))
        for r in requests:
            engine.abort(r.request_id)
        while engine.has_unfinished_requests():
            engine.step()
        engine.step()  # collect the abort outputs
        return rounds

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


#: In every repeat of the cost profile a plain run precedes the first cell and follows every this many cells.
PLAIN_EVERY = 4


def repeat_order(cells: Sequence[tuple[int, int]], rng: random.Random) -> list[tuple[int, int]]:
    """One repeat's run order: the cells shuffled, plain (0, 0) first, after every `PLAIN_EVERY` cells and last,
    so every cell run has a plain run on either side of it within a few runs."""
    order = list(cells)
    rng.shuffle(order)
    out: list[tuple[int, int]] = []
    for i, cell in enumerate(order):
        if i % PLAIN_EVERY == 0:
            out.append((0, 0))
        out.append(cell)
    out.append((0, 0))
    return out


def drift_correct(order: Sequence[tuple[int, int]], runs: Sequence[list[TimedRound]], reference: float) -> list[float]:
    """Per run of one repeat: the factor that brings it to the machine speed at which plain runs cost `reference`.

    The local plain level of a cell run is the mean of the trimmed mean round times of the nearest plain run
    before and after it; the factor is `reference` / that level (plain runs themselves: 1). This machine's
    speed drifts by ±20 % over seconds; a cell measured during a fast spell would otherwise look cheap against
    plain measured in a slow one, which is the one number every plan is compared with.
    """
    levels = [trimmed_mean([r.seconds for r in run]) if run else float("nan") for run in runs]
    plain_at = [i for i, cell in enumerate(order) if cell[0] == 0 and levels[i] == levels[i]]
    factors = []
    for i, cell in enumerate(order):
        before = [levels[j] for j in plain_at if j < i][-1:]
        after = [levels[j] for j in plain_at if j > i][:1]
        local = before + after
        factors.append(1.0 if cell[0] == 0 or not local else reference * len(local) / sum(local))
    return factors


def profile_costs(
    timer: RoundTimer,
    cells: Sequence[tuple[int, int]],
    batch_sizes: Sequence[int],
    prompts: list[Any],
    horizon: int,
    repeats: int,
    seed: int,
    bar=None,
) -> Samples:
    """Timed rounds per batch size, cell (plain = (0, 0)) and run, cell runs drift-corrected (`drift_correct`)
    to the median plain run; configurations interleaved (`repeat_order`), the first repeat dropped."""
    rng = random.Random(seed)
    samples: Samples = {}
    for b in batch_sizes:
        kept: list[tuple[list[tuple[int, int]], list[list[TimedRound]]]] = []
        for repeat in range(repeats + 1):
            order = repeat_order(cells, rng)
            runs = []
            for cell in order:
                runs.append(timer.time_rounds(cell, prompts[:b], horizon))
                if bar is not None:
                    bar.update(1)
            if repeat > 0:
                kept.append((order, runs))
        plain_levels = [
            trimmed_mean([r.seconds for r in run]) for o, rs in kept for c, run in zip(o, rs) if not c[0] and run
        ]
        reference = statistics.median(plain_levels) if plain_levels else 1.0
        samples[b] = {c: [] for c in [(0, 0), *cells]}
        for order, runs in kept:
            for cell, run, f in zip(order, runs, drift_correct(order, runs, reference)):
                if run:
                    samples[b][cell].append([TimedRound(r.seconds * f, r.context) for r in run])
    return samples


def runs_per_repeat(num_cells: int) -> int:
    """Runs in one repeat of `repeat_order`: every cell once and plain 1 + ceil(num_cells / PLAIN_EVERY) times."""
    return num_cells + 1 + -(-num_cells // PLAIN_EVERY)


def trimmed_mean(values: Sequence[float], trim: float = 0.1) -> float:
    """Mean of the values without the smallest and the largest `trim` fraction (each side)."""
    ordered = sorted(values)
    cut = int(len(ordered) * trim)
    kept = ordered[cut : len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def run_cost(runs: list[list[float]]) -> tuple[float, float]:
    """(median run cost, (largest - smallest) / smallest run cost) of one configuration's timed runs.

    A run's cost is the 10%-trimmed mean of its round seconds: a mean, because the rounds of a run sit at
    growing contexts and throughput is set by their sum; trimmed, so one stalled round does not decide it.
    Over the runs the median: the runs are drift-corrected to one machine speed (`drift_correct`), and the
    smallest of them would be the luckiest, with more plain runs than cell runs to be lucky in.
    """
    if not runs:
        raise TunerError("a configuration produced no full-shape decode round to time; raise --profile-tokens")
    costs = [trimmed_mean(r) for r in runs]
    best = min(costs)
    return statistics.median(costs), (max(costs) - best) / best if best > 0 else 0.0


#: Theil–Sen looks at every pair of rounds of a run; beyond this many pairs (per cell, all runs together) at a
#: seeded sample of them: the median of 40 000 pair slopes is as good as all of them, and a long
#: --profile-tokens would otherwise spend minutes here.
MAX_PAIRS = 40_000


def theil_sen_slope(runs: Sequence[Sequence[tuple[float, float]]], max_pairs: int = MAX_PAIRS, seed: int = 0) -> float:
    """Median of the slopes between pairs of (x, y) points of the same run with different x; 0.0 without any.

    Theil–Sen, with pairs taken within a run only (as the seasonal Kendall slope takes them within a season):
    runs differ in level (a run disturbed all along is slower at every context), and a pair across runs would
    read that difference as slope.
    """
    counts = [len(run) * (len(run) - 1) // 2 for run in runs]
    if sum(counts) <= max_pairs:
        pairs = [(run[i], run[j]) for run in runs for i in range(len(run)) for j in range(i + 1, len(run))]
    else:  # every pair equally likely: a run by its number of pairs, then two of its points
        rng = random.Random(seed)
        chosen = rng.choices(runs, weights=counts, k=max_pairs)
        pairs = [(run[i], run[j]) for run in chosen for i, j in [rng.sample(range(len(run)), 2)]]
    slopes = [(y1 - y0) / (x1 - x0) for (x0, y0), (x1, y1) in pairs if x1 != x0]
    return statistics.median(slopes) if slopes else 0.0


def line_intercept(runs: list[list[TimedRound]], slope: float) -> float:
    """Intercept of round seconds = intercept + slope·context: the median over runs of the median of y − slope·x.

    The median over a run, where `run_cost` takes a 10 %-trimmed mean: the line is to price an undisturbed round
    at any context, and a trimmed mean still follows outlier rounds beyond its trim. The median over the
    (drift-corrected) runs for the same reason as in `run_cost`.
    """
    return statistics.median(statistics.median(r.seconds - slope * r.context for r in run) for run in runs)


def context_lines(samples: Samples) -> dict[int, dict[tuple[int, int], tuple[float, float]]]:
    """(intercept, slope) of round seconds against the batch's mean context per batch size and configuration.

    Slope: Theil–Sen (the median of pairwise slopes, pairs within a run) over every kept run of the cell.
    Rounds on a shared machine have outliers of ±30 % and more, and not only a few: Theil–Sen's slope stays
    put with up to ~29 % of the rounds arbitrarily wrong, where a single stalled round drags a least-squares
    slope (the rounds at the ends of the horizon, which pin the slope, have the most leverage); it also needs
    no binning choice (per-bin means would). Guards: slopes are clamped at 0 (a longer context never makes a
    round cheaper) and made non-decreasing in the batch size, and so are the lines' values at each batch size's
    reference context (`mean_contexts`, where the rounds were timed), so a round's predicted cost does not fall
    with B from those contexts on. The values at the reference are pooled, not the intercepts at context 0: a
    short horizon's noisy slope puts its intercept far below its rounds, and pooling that extrapolation once
    dragged the line of a smaller batch below zero (an 8-token tune: (2, 1) at B = 1 timed at 3.5 ms, priced ~0).
    """
    sizes = sorted(samples)
    refs = mean_contexts(samples)
    lines: dict[int, dict[tuple[int, int], tuple[float, float]]] = {b: {} for b in sizes}
    for cell in samples[sizes[0]]:
        slopes = []
        for b in sizes:
            runs = [[(r.context, r.seconds) for r in run] for run in samples[b][cell]]
            slopes.append(max(theil_sen_slope(runs), 0.0))
        slopes = nondecreasing(slopes)
        levels = nondecreasing([line_intercept(samples[b][cell], s) + s * refs[b] for b, s in zip(sizes, slopes)])
        for b, level, slope in zip(sizes, levels, slopes):
            lines[b][cell] = (level - slope * refs[b], slope)
    return lines


def mean_contexts(samples: Samples) -> dict[int, float]:
    """Mean context of every kept timed round per batch size (all configurations): the profile's reference."""
    out = {}
    for b, cells in samples.items():
        contexts = [r.context for runs in cells.values() for run in runs for r in run]
        out[b] = sum(contexts) / len(contexts) if contexts else 0.0
    return out


def fit_profile(depth: int, samples: Samples) -> tuple[CostProfile, dict]:
    """Timed runs -> `CostProfile` (with context terms); report with per-cell costs, spreads, lines and fits."""
    sizes = sorted(samples)
    costs = {b: {c: run_cost(_seconds(runs)) for c, runs in samples[b].items()} for b in sizes}
    monotone: dict[int, dict[tuple[int, int], float]] = {b: {} for b in sizes}
    for cell in costs[sizes[0]]:
        for b, value in zip(sizes, nondecreasing([costs[b][cell][0] for b in sizes])):
            monotone[b][cell] = value
    plain = {b: monotone[b][(0, 0)] for b in sizes}
    cells = {b: {c: v for c, v in monotone[b].items() if c[0] > 0} for b in sizes}
    lines = context_lines(samples)
    profile = CostProfile.fit(depth, plain, cells, lines, mean_contexts(samples))
    report: dict[str, Any] = {}
    for b in sizes:
        report[str(b)] = {
            f"{c[0]},{c[1]}": _cell_report(profile, samples[b][c], c, b, cost, monotone[b][c], spread, lines[b][c])
            for c, (cost, spread) in costs[b].items()
        }
    return profile, report


def _seconds(runs: list[list[TimedRound]]) -> list[list[float]]:
    return [[r.seconds for r in run] for run in runs]


def refit_context_terms(profile: CostProfile, report: dict[str, Any]) -> CostProfile:
    """`profile` with its context terms fitted again by the current code from the per-cell lines (and costs)
    its tuning run's report keeps, without timing anything (`looped-spec tune --cost-from`). A profile without
    context terms, or a report without lines for every profiled batch size, comes back unchanged."""
    if not profile.has_context or profile.reference_context is None:
        return profile
    lines: dict[int, dict[tuple[int, int], tuple[float, float]]] = {}
    costs: dict[int, dict[tuple[int, int], float]] = {}
    for b in profile.batch_sizes:
        cells = report.get(str(b), {})
        row = {}
        for key, cell in cells.items():
            if isinstance(cell, dict) and {"intercept_s", "slope_s_per_token", "cost_s"} <= cell.keys():
                k, d = (int(x) for x in key.split(","))
                row[(k, d)] = (float(cell["intercept_s"]), float(cell["slope_s_per_token"]))
                costs.setdefault(b, {})[(k, d)] = float(cell["cost_s"])
        if (0, 0) not in row or len(row) < 2:
            return profile
        lines[b] = row
    refit = CostProfile.fit(
        profile.depth,
        dict(zip(profile.batch_sizes, profile.plain_seconds)),
        {b: {c: v for c, v in costs[b].items() if c[0] > 0} for b in profile.batch_sizes},
        lines,
        dict(zip(profile.batch_sizes, profile.reference_context)),
    )
    # the averaged terms stay exactly as stored (the report's costs are rounded)
    return CostProfile(
        profile.depth, profile.batch_sizes, profile.plain_seconds, profile.coefficients,
        **{name: getattr(refit, name) for name in CONTEXT_FIELDS},
    )  # fmt: skip


def _cell_report(
    profile: CostProfile,
    runs: list[list[TimedRound]],
    cell: tuple[int, int],
    batch: int,
    median: float,
    cost: float,
    spread: float,
    line: tuple[float, float],
) -> dict[str, Any]:
    """One cell's report: its costs, its context line, and both fits (averaged; at its own mean context)."""
    k, d = cell
    rounds = [r for run in runs for r in run]
    context = sum(r.context for r in rounds) / len(rounds)
    out: dict[str, Any] = {
        "median_run_s": round(median, 6),  # drift-corrected runs (`run_cost`)
        "best_run_s": round(min(trimmed_mean([r.seconds for r in run]) for run in runs), 6),
        "cost_s": round(cost, 6),
        "spread": round(spread, 3),
        "runs": len(runs),
        "context": round(context, 1),
        "intercept_s": round(line[0], 6),
        "slope_s_per_token": float(f"{line[1]:.4g}"),
    }
    if k:
        out["fit_s"] = round(profile.predict(k, d, batch), 6)
    out["context_fit_s"] = round(profile.predict(k, d, batch, context), 6)
    return out


# ----------------------------------------------------------------------------------------- the tuner
def tune(
    model: str | Path | ModelAdapter,
    batch_sizes: str | Sequence[int] = (1, 2, 4, 8, 16, 32),
    prompts: str | Sequence[Any] = "tune",
    grid: str | Sequence[tuple[int, int]] = "auto",
    *,
    acceptance_tokens: int = 96,
    num_prompts: int = 32,
    profile_tokens: int = 64,
    repeats: int = 4,
    cost_profile: CostProfile | dict | None = None,
    cost_report: dict[str, Any] | None = None,
    cost_profile_source: str | None = None,
    cost_measured: str | None = None,
    hardware: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    adapter_options: dict[str, Any] | None = None,
    margin: float = 0.03,
    seed: int = 0,
    command: str | None = None,
    progress: bool = True,
) -> tuple[AdaptiveSpecConfig, dict[str, Any]]:
    """Measure acceptance and round cost, derive a preset; returns (validated preset, report = provenance).

    `cost_profile` (a `CostProfile` or its `to_dict()`) skips the timing: the result is then deterministic;
    `cost_report` is then the measurement report of that profile, kept in the provenance (e.g. when
    re-deriving a preset with `looped-spec tune --cost-from PRESET`).
    """
    started = time.perf_counter()
    sizes = parse_batch_sizes(batch_sizes)
    for name, value, low in (
        ("acceptance_tokens", acceptance_tokens, 2),
        ("num_prompts", num_prompts, 1),
        ("profile_tokens", profile_tokens, 2),
        ("repeats", repeats, 1),
    ):
        if value < low:
            raise TunerError(f"{name}={value} must be >= {low}")
    if isinstance(model, ModelAdapter):
        adapter = model
    else:
        adapter = load_adapter(model, dtype=dtype, device=device, **(adapter_options or {}))
    depth = adapter.full_depth
    if depth < 2:
        raise TunerError(f"the model has full depth D={depth}; self-speculation needs D >= 2")
    cells = parse_grid(grid, depth)
    prompt_list, prompt_what = load_prompts(prompts, adapter, max(num_prompts, max(sizes)))
    tokenizer = load_tokenizer(adapter.path) if any(isinstance(p, str) for p in prompt_list) else None
    longest = max(len(to_token_ids(p, tokenizer, adapter.vocab_size, f"prompt {p!r}")) for p in prompt_list)
    max_k = max(k for k, _ in cells)
    need = longest + max(acceptance_tokens, 2 * profile_tokens + max_k + 2)
    if need >= adapter.max_positions:
        raise TunerError(f"prompts of up to {longest} tokens + the output tokens exceed {adapter.max_positions}")
    profile = CostProfile(depth, **cost_profile) if isinstance(cost_profile, dict) else cost_profile
    timed = profile is None
    total = num_prompts + (len(sizes) * (repeats + 1) * runs_per_repeat(len(cells)) if timed else 0)
    bar = _progress(total, progress)
    timer = None
    try:
        bits = measure_match_bits(adapter, prompt_list[:num_prompts], acceptance_tokens, bar)
        accept = acceptance_report(bits, cells)
        if accept["positions"] == 0:
            raise TunerError("the acceptance pass measured no generated position: nothing was drafted; no preset")
        cost_report = dict(cost_report or {})
        if timed:
            timer = RoundTimer(adapter, max(sizes), min(adapter.max_positions, need + 8), prompt_list[:2])
            samples = profile_costs(timer, cells, sizes, prompt_list, profile_tokens, repeats, seed, bar)
            profile, cost_report = fit_profile(depth, samples)
    finally:
        bar.close()
        if timer is not None:
            timer.close()
    assert profile is not None
    models = {
        b: BucketModel(
            accept["alpha"], accept["rho"], lambda k, d, b=b: profile.predict(k, d, b), acceptance_variants(bits, b)
        )
        for b in sizes
    }
    buckets, disable, decisions = derive_buckets(models, cells, bucket_ranges(sizes), margin=margin)
    tag = hardware or hardware_tag(adapter.device)
    now = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
    report = {
        "tool": "looped_spec.tuning.tuner",
        "command": command or f"looped_spec.tuning.tuner.tune({adapter.name!r}, batch_sizes={sizes}, grid={grid!r})",
        "date": now,
        "cost_measured": now if timed else cost_measured,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(adapter),
        "model": {
            "path": adapter.path,
            "name": adapter.name,
            "model_type": adapter.model_type,
            "full_depth": depth,
            "adapter_options": adapter_options or {},
        },
        "prompts": {
            "source": prompts if isinstance(prompts, str) else "caller",
            "description": prompt_what,
            "fingerprints": prompt_fingerprints(prompt_list),
        },
        "settings": {
            "batch_sizes": sizes,
            "grid": [f"{k},{d}" for k, d in cells],
            "acceptance_tokens": acceptance_tokens,
            "num_prompts": num_prompts,
            "profile_tokens": profile_tokens if timed else None,
            "repeats": repeats if timed else None,
            "margin": margin,
            "cost_profile": "measured" if timed else (cost_profile_source or "given"),
        },
        "acceptance": accept,
        "cost": cost_report,
        "decisions": decisions,
        "rules": dict(RULES),
    }
    data = {
        "model": adapter.name,
        "hardware": tag,
        "full_depth": depth,
        "depth_rule": "exact",
        "buckets": buckets,
        "disable": disable,
        "acceptance": {
            "alpha": accept["alpha"],
            "rho": accept["rho"],
            "positions": accept["positions"],
            "spread": accept["spread"],
        },
        "cost": {k: _rounded(v) for k, v in profile.to_dict().items()},
        "provenance": report,
    }
    config = AdaptiveSpecConfig.parse(data, source="tuned preset")
    config.validate_for_depth(depth)
    return config, report


def _rounded(value: Any) -> Any:
    if isinstance(value, float):
        return float(f"{value:.6g}")
    if isinstance(value, list):
        return [_rounded(v) for v in value]
    return value


__all__ = ["TunerError", "tune", "measure_match_bits", "acceptance_report", "fit_profile"]
