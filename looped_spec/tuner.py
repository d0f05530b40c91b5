"""Offline tuner: time (K, d) against plain decoding per batch size and derive an adaptive-speculation preset.

    looped-spec tune --model tiny-ouro --batch-sizes 1,8,32 --prompts builtin --out presets/my-model.json

1. Screen: every (K, d) of the grid at every batch size with short greedy outputs (ignore_eos), one engine
   per setting built once on one loaded adapter and warmed up; decode tokens/s as a ratio to plain
   decoding's, the acceptance ΣA/ΣK from the engine's counters, tokens per request per round. Every
   speculative output must equal plain decoding's token for token (`GreedyMismatchError` otherwise).
2. Confirm: the `top` cells of each batch size by screened ratio, longer outputs, `repeats` rounds of
   plain then every top cell, median of the per-round ratios.
3. Preset: buckets, candidate order, initial candidate, thresholds and EMA knobs from the confirmed cells
   (`looped_spec.tuner_rules`, whose rule texts go into the preset's provenance), validated with
   `AdaptiveSpecConfig` for the model's depth before it is returned.
"""

from __future__ import annotations

import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from looped_spec.adapter import ModelAdapter, load_adapter
from looped_spec.control.presets import AdaptiveSpecConfig
from looped_spec.engine import LoopedSpecEngine
from looped_spec.inputs import load_tokenizer, to_token_ids
from looped_spec.sampling_params import SamplingParams, SpeculativeConfig
from looped_spec.tuner_inputs import (
    GreedyMismatchError,
    TunerError,
    hardware_tag,
    load_prompts,
    machine_info,
    parse_batch_sizes,
    parse_grid,
)
from looped_spec.tuner_rules import RULES, build_preset


# ----------------------------------------------------------------------------------------- measuring
@dataclass
class RunResult:
    """One timed `generate()` call and the engine counters it moved."""

    wall: float
    prefill_seconds: float
    tokens: int
    requests: int
    request_rounds: int  # decode rounds summed over requests
    proposed: int
    accepted: int
    outputs: list[list[int]]

    @property
    def decode_tokens_per_s(self) -> float:
        return (self.tokens - self.requests) / max(self.wall - self.prefill_seconds, 1e-9)

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / max(self.wall, 1e-9)

    @property
    def acceptance(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_round(self) -> float:
        """Committed tokens per request per decode round."""
        return (self.tokens - self.requests) / self.request_rounds if self.request_rounds else 0.0


class Progress:
    """tqdm when importable, else a one-line progress printer on stderr."""

    def __init__(self, total: int, enabled: bool = True) -> None:
        self.total, self.done, self.enabled = total, 0, enabled
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm

                self._bar = tqdm(total=total, desc="tune", file=sys.stderr, dynamic_ncols=True)
            except ImportError:
                self._bar = None

    def step(self, label: str) -> None:
        self.done += 1
        if self._bar is not None:
            self._bar.set_postfix_str(label, refresh=False)
            self._bar.update(1)
        elif self.enabled:
            print(f"\rtune [{self.done}/{self.total}] {label:<40}", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


class EngineSet:
    """One engine per (K, d) setting (K=0: plain) on one shared adapter, each built once and warmed up."""

    def __init__(self, adapter: ModelAdapter, max_batch: int, max_model_len: int, warmup: list[Any]) -> None:
        self.adapter, self.max_batch, self.max_model_len, self.warmup = adapter, max_batch, max_model_len, warmup
        self.engines: dict[tuple[int, int], LoopedSpecEngine] = {}

    def get(self, cell: tuple[int, int]) -> LoopedSpecEngine:
        if cell not in self.engines:
            spec = "off" if cell[0] == 0 else SpeculativeConfig(k=cell[0], d=cell[1])
            engine = LoopedSpecEngine(
                self.adapter, speculation=spec, max_batch_size=self.max_batch, max_model_len=self.max_model_len
            )
            engine.generate(self.warmup, SamplingParams(max_tokens=4, ignore_eos=True))
            self.engines[cell] = engine
        return self.engines[cell]

    def run(self, cell: tuple[int, int], prompts: list[Any], max_tokens: int) -> RunResult:
        engine = self.get(cell)
        params = [SamplingParams(max_tokens=max_tokens, ignore_eos=True, seed=i) for i in range(len(prompts))]
        s = engine.stats
        p0, d0, a0 = s.phase_seconds["prefill"], s.num_draft_tokens, s.num_accepted_tokens
        start = time.perf_counter()
        outs = engine.generate(prompts, params)
        wall = time.perf_counter() - start
        return RunResult(
            wall,
            s.phase_seconds["prefill"] - p0,
            sum(len(o.token_ids) for o in outs),
            len(outs),
            sum(o.metrics.rounds for o in outs),
            s.num_draft_tokens - d0,
            s.num_accepted_tokens - a0,
            [list(o.token_ids) for o in outs],
        )

    def close(self) -> None:
        for engine in self.engines.values():
            engine.close()


def _check_equal(plain: RunResult, spec: RunResult, cell: tuple[int, int], batch: int, phase: str) -> None:
    for i, (a, b) in enumerate(zip(plain.outputs, spec.outputs)):
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            raise GreedyMismatchError(
                f"{phase}: greedy output of K={cell[0]} d={cell[1]} at batch size {batch} differs from plain "
                f"decoding for prompt {i} at output position {pos} (plain {a[pos : pos + 4]}, speculative "
                f"{b[pos : pos + 4]}); this is an engine bug, please report it"
            )


def _cell(run: RunResult, plain_tps: float) -> dict[str, float]:
    return {
        "ratio": round(run.decode_tokens_per_s / plain_tps, 4),
        "acceptance": round(run.acceptance, 4),
        "tokens_per_round": round(run.tokens_per_round, 4),
        "decode_tokens_per_s": round(run.decode_tokens_per_s, 2),
        "proposed": run.proposed,
        "accepted": run.accepted,
        "wall_s": round(run.wall, 4),
    }


def _screen(bench: EngineSet, grid, prompts, tokens: int, progress: Progress, batch: int) -> dict[str, Any]:
    before = bench.run((0, 0), prompts, tokens)
    progress.step(f"B={batch} plain")
    runs = {}
    for cell in grid:
        runs[cell] = bench.run(cell, prompts, tokens)
        _check_equal(before, runs[cell], cell, batch, "screen")
        progress.step(f"B={batch} K={cell[0]} d={cell[1]}")
    after = bench.run((0, 0), prompts, tokens)
    progress.step(f"B={batch} plain")
    plain_tps = statistics.mean([before.decode_tokens_per_s, after.decode_tokens_per_s])
    return {
        "plain_decode_tokens_per_s": round(plain_tps, 2),
        "plain_tokens_per_s": round(before.tokens_per_s, 2),
        "cells": {f"{k},{d}": _cell(run, plain_tps) for (k, d), run in runs.items()},
    }


def _confirm(bench: EngineSet, top, prompts, tokens: int, repeats: int, progress: Progress, batch: int) -> dict:
    ratios: dict[tuple[int, int], list[float]] = {c: [] for c in top}
    last: dict[tuple[int, int], RunResult] = {}
    plain_tps = []
    for r in range(repeats):
        plain = bench.run((0, 0), prompts, tokens)
        plain_tps.append(plain.decode_tokens_per_s)
        progress.step(f"B={batch} confirm {r + 1}/{repeats} plain")
        for cell in top:
            last[cell] = bench.run(cell, prompts, tokens)
            _check_equal(plain, last[cell], cell, batch, "confirm")
            ratios[cell].append(last[cell].decode_tokens_per_s / plain.decode_tokens_per_s)
            progress.step(f"B={batch} confirm {r + 1}/{repeats} K={cell[0]} d={cell[1]}")
    cells = {}
    for cell in top:
        entry = _cell(last[cell], statistics.median(plain_tps))
        entry.update(ratio=round(statistics.median(ratios[cell]), 4), ratios=[round(x, 4) for x in ratios[cell]])
        cells[f"{cell[0]},{cell[1]}"] = entry
    return {"plain_decode_tokens_per_s": [round(x, 2) for x in plain_tps], "cells": cells}


# ----------------------------------------------------------------------------------------- the tuner
def tune(
    model: str | Path | ModelAdapter,
    batch_sizes: str | Sequence[int] = (1, 8, 32),
    prompts: str | Sequence[Any] = "builtin",
    grid: str | Sequence[tuple[int, int]] = "auto",
    screen_tokens: int = 16,
    confirm_tokens: int = 64,
    top: int = 3,
    *,
    repeats: int = 3,
    hardware: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    adapter_options: dict[str, Any] | None = None,
    margin: float = 0.03,
    min_gain: float = 0.02,
    command: str | None = None,
    progress: bool = True,
) -> tuple[AdaptiveSpecConfig, dict[str, Any]]:
    """Measure the grid, confirm the best cells and derive a preset; returns (validated preset, report).

    The report is the preset's provenance: command, date, machine, model, prompts, settings, every
    measured cell per batch size ("measurements"), the per-bucket decisions and the rules used.
    """
    started = time.perf_counter()
    sizes = parse_batch_sizes(batch_sizes)
    for name, value in (
        ("screen_tokens", screen_tokens),
        ("confirm_tokens", confirm_tokens),
        ("top", top),
        ("repeats", repeats),
    ):
        if value < 1:
            raise TunerError(f"{name}={value} must be >= 1")
    if isinstance(model, ModelAdapter):
        adapter = model
    else:
        adapter = load_adapter(model, dtype=dtype, device=device, **(adapter_options or {}))
    depth = adapter.full_depth
    cells = parse_grid(grid, depth)
    prompt_list, prompt_what = load_prompts(prompts, adapter, max(sizes))
    tokenizer = load_tokenizer(adapter.path) if any(isinstance(p, str) for p in prompt_list) else None
    longest = max(len(to_token_ids(p, tokenizer, adapter.vocab_size, f"prompt {p!r}")) for p in prompt_list)
    need = longest + max(screen_tokens, confirm_tokens)
    if need >= adapter.max_positions:
        raise TunerError(
            f"prompts of up to {longest} tokens + {max(screen_tokens, confirm_tokens)} output tokens "
            f"exceed the model's {adapter.max_positions} positions"
        )
    bench = EngineSet(adapter, max(sizes), min(adapter.max_positions, need + 8), prompt_list[:2])
    top = min(top, len(cells))
    bar = Progress(len(sizes) * (len(cells) + 2 + repeats * (top + 1)) + len(cells) + 1, enabled=progress)
    measurements: dict[int, dict[str, Any]] = {}
    try:
        for cell in [(0, 0), *cells]:
            bench.get(cell)
            bar.step(f"build K={cell[0]} d={cell[1]}")
        for b in sizes:
            screen = _screen(bench, cells, prompt_list[:b], screen_tokens, bar, b)
            ranked = sorted(cells, key=lambda c: -screen["cells"][f"{c[0]},{c[1]}"]["ratio"])[:top]
            confirm = _confirm(bench, ranked, prompt_list[:b], confirm_tokens, repeats, bar, b)
            measurements[b] = {"screen": screen, "confirm": confirm}
    finally:
        bar.close()
        bench.close()
    tag = hardware or hardware_tag(adapter.device)
    data, decisions = build_preset(adapter.name, depth, tag, measurements, margin=margin, min_gain=min_gain)
    report = {
        "tool": "looped_spec.tuner",
        "command": command or _api_command(model, sizes, prompts, grid, screen_tokens, confirm_tokens, top, repeats),
        "date": datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds"),
        "wall_seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(adapter),
        "model": {
            "path": adapter.path,
            "name": adapter.name,
            "model_type": adapter.model_type,
            "full_depth": depth,
            "adapter_options": adapter_options or {},
        },
        "prompts": {"source": prompts if isinstance(prompts, str) else "caller", "description": prompt_what},
        "settings": {
            "batch_sizes": sizes,
            "grid": [f"{k},{d}" for k, d in cells],
            "screen_tokens": screen_tokens,
            "confirm_tokens": confirm_tokens,
            "top": top,
            "repeats": repeats,
            "margin": margin,
            "min_gain": min_gain,
            "sampling": "greedy, ignore_eos",
        },
        "measurements": {str(b): m for b, m in measurements.items()},
        "decisions": decisions,
        "rules": dict(RULES),
    }
    data["provenance"] = report
    config = AdaptiveSpecConfig.parse(data, source="tuned preset")
    config.validate_for_depth(depth)
    return config, report


def _api_command(model, sizes, prompts, grid, screen_tokens, confirm_tokens, top, repeats) -> str:
    name = model.name if isinstance(model, ModelAdapter) else str(model)
    prompt_text = prompts if isinstance(prompts, str) else f"<{len(prompts)} prompts>"
    return (
        f"looped_spec.tuner.tune({name!r}, batch_sizes={sizes}, prompts={prompt_text!r}, grid={grid!r}, "
        f"screen_tokens={screen_tokens}, confirm_tokens={confirm_tokens}, top={top}, repeats={repeats})"
    )


__all__ = ["GreedyMismatchError", "TunerError", "tune"]
