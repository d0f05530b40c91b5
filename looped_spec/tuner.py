"""Offline tuner: time (K, d) against plain decoding per batch size and derive an adaptive-speculation preset.

    looped-spec tune --model tiny-ouro --batch-sizes 1,8,32 --prompts builtin --out presets/my-model.json

1. Screen: every (K, d) of the grid at every batch size with short greedy outputs (ignore_eos), one engine
   per setting built once on one loaded adapter and warmed up; decode tokens/s as a ratio to plain
   decoding's, the acceptance ΣA/ΣK from the engine's counters, tokens per request per round. Every
   speculative output must equal plain decoding's token for token (`GreedyMismatchError` otherwise).
2. Confirm: the `top` cells of each batch size by screened ratio, longer outputs, `repeats` rounds of
   plain then every top cell, median of the per-round ratios.
3. Preset: buckets, candidate order, initial candidate, thresholds and EMA knobs from the confirmed cells
   (`looped_spec.tuner_report`, whose rule texts go into the preset's provenance), validated with
   `AdaptiveSpecConfig` for the model's depth before it is returned.
"""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import torch

from looped_spec.adapter import ModelAdapter, load_adapter
from looped_spec.control.presets import AdaptiveSpecConfig
from looped_spec.engine import LoopedSpecEngine
from looped_spec.inputs import load_tokenizer, to_token_ids
from looped_spec.sampling_params import SamplingParams, SpeculativeConfig
from looped_spec.tuner_report import RULES, build_preset

BUILTIN_CODE_PROMPTS = (  # each ends where the body starts, so a code model writes code, not blank lines
    'def is_palindrome(text: str) -> bool:\n    """Return True if text reads the same backwards."""\n    ',
    'def flatten(items):\n    """Flatten a list of lists into one list."""\n    result = []\n    ',
    'def count_words(path):\n    """Count how often each word occurs in the file at path."""\n    ',
    'def merge_dicts(a, b):\n    """Return a new dict with the keys of a and b; b wins."""\n    ',
    'def parse_version(text):\n    """Split a version string like \'1.2.3\' into a tuple of ints."""\n    ',
    'class Stack:\n    """A last-in, first-out stack."""\n\n    def __init__(self):\n        ',
    'def read_config(filename):\n    """Read key=value lines from filename into a dict."""\n    ',
    'def chunks(seq, size):\n    """Yield successive chunks of length size from seq."""\n    for i in ',
    'def gcd(a, b):\n    """Return the greatest common divisor of a and b."""\n    while ',
    'def unique(items):\n    """Return the items without duplicates, keeping their order."""\n    ',
    'def to_snake_case(name):\n    """Convert a CamelCase name to snake_case."""\n    ',
    'def binary_search(values, target):\n    """Return the index of target in the sorted list values, or -1."""\n    ',
)
BUILTIN_PROSE_PROMPTS = (
    "The quick brown fox jumps over the lazy dog, and then",
    "In the morning the town was quiet; the baker opened his shop and",
    "A good function does one thing, and it does it well. For example,",
    "The river ran past the old mill, where",
)


class TunerError(ValueError):
    """Bad tuner input (grid, batch sizes, prompts); the CLI exits with status 2."""


class GreedyMismatchError(AssertionError):
    """A speculative greedy output differed from plain decoding's: a bug in the engine, please report it."""


# ----------------------------------------------------------------------------------------- inputs
def parse_batch_sizes(spec: str | Sequence[int]) -> list[int]:
    """Parse "1,8,32" or [1, 8, 32] -> sorted distinct positive batch sizes."""
    items = spec.split(",") if isinstance(spec, str) else list(spec)
    try:
        sizes = sorted({int(str(x).strip()) for x in items if str(x).strip()})
    except ValueError:
        raise TunerError(f"--batch-sizes {spec!r}: expected comma-separated integers like 1,8,32") from None
    if not sizes or sizes[0] < 1:
        raise TunerError(f"--batch-sizes {spec!r}: need at least one batch size, all >= 1")
    return sizes


def auto_grid(depth: int) -> list[tuple[int, int]]:
    """K in 1..5 times d in 1..D-1 (d in {1, 2, D/4, D/2, D-1} when D > 5)."""
    ds = range(1, depth) if depth <= 5 else sorted({d for d in (1, 2, depth // 4, depth // 2, depth - 1) if d >= 1})
    return [(k, d) for k in range(1, 6) for d in ds]


def parse_grid(spec: str | Sequence[tuple[int, int]], depth: int) -> list[tuple[int, int]]:
    """'auto' or 'K,d;K,d;...' (or pairs) -> distinct cells; every entry is checked against depth D."""
    if isinstance(spec, str) and spec.strip().lower() == "auto":
        grid = auto_grid(depth)
        if not grid:
            raise TunerError(f"--grid auto: the model has full depth D={depth}; self-speculation needs D >= 2")
        return grid
    entries = [e.strip() for e in spec.split(";") if e.strip()] if isinstance(spec, str) else list(spec)
    if not entries:
        raise TunerError(f"--grid {spec!r}: no entries; use 'auto' or 'K,d;K,d'")
    grid: list[tuple[int, int]] = []
    for entry in entries:
        text = entry if isinstance(entry, str) else ",".join(map(str, entry))
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 2 or not all(p.lstrip("-").isdigit() for p in parts):
            raise TunerError(f"--grid entry {text!r}: expected 'K,d' with integers K and d")
        k, d = int(parts[0]), int(parts[1])
        if not 1 <= k <= 64:
            raise TunerError(f"--grid entry {text!r}: K={k} must be in 1..64 (plain decoding is always measured)")
        if not 1 <= d < depth:
            raise TunerError(f"--grid entry {text!r}: d={d} must be in 1..{depth - 1} (d < full depth D={depth})")
        if (k, d) not in grid:
            grid.append((k, d))
    return grid


def parse_adapter_options(items: Sequence[str] | None) -> dict[str, Any]:
    """["key=value", ...] -> options; values parse as JSON scalars where they can (3, 0.5, true), else strings."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TunerError(f"--adapter-option {item!r}: expected KEY=VALUE")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def has_tokenizer(path: str | None) -> bool:
    """True when the checkpoint folder carries tokenizer files (the engine then accepts text prompts)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    return path is not None and any((Path(path) / n).is_file() for n in names)


def random_token_prompts(count: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Deterministic random token-id prompts of 8..23 tokens (ids 3..vocab-1 where the vocabulary allows)."""
    rng = random.Random(seed)
    low = 3 if vocab_size > 3 else 0
    return [[rng.randrange(low, vocab_size) for _ in range(rng.randrange(8, 24))] for _ in range(count)]


def load_prompts(source: str | Sequence[Any], adapter: ModelAdapter, count: int) -> tuple[list[Any], str]:
    """`count` prompts (cycled) and a description: 'builtin', a .txt (one per line) / .jsonl file, or a list."""
    if isinstance(source, str) and source == "builtin":
        if has_tokenizer(adapter.path):
            base: list[Any] = list(BUILTIN_CODE_PROMPTS + BUILTIN_PROSE_PROMPTS)
            n_code, n_prose = len(BUILTIN_CODE_PROMPTS), len(BUILTIN_PROSE_PROMPTS)
            what = f"builtin: {n_code} Python function headers + {n_prose} English sentences"
        else:
            base = random_token_prompts(max(count, 1), adapter.vocab_size)
            what = f"builtin: {len(base)} random token-id prompts (seed 0; the model has no tokenizer)"
    elif isinstance(source, (str, Path)):
        path = Path(source)
        if not path.is_file():
            raise TunerError(f"--prompts {source}: not 'builtin' and no such file")
        base = _read_prompt_file(path)
        what = f"file {path} ({len(base)} prompts)"
    else:
        base = list(source)
        what = f"{len(base)} prompts given by the caller"
    if not base:
        raise TunerError(f"--prompts {source}: no prompts")
    return [base[i % len(base)] for i in range(count)], what


def _read_prompt_file(path: Path) -> list[Any]:
    lines = path.read_text(encoding="utf-8").splitlines()
    if path.suffix != ".jsonl":
        return [line for line in lines if line.strip()]
    prompts = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            prompts.append(json.loads(line)["prompt"])
        except (json.JSONDecodeError, KeyError, TypeError):
            raise TunerError(f"{path}:{n}: expected a JSON object with a 'prompt' field") from None
    return prompts


def hardware_tag(device: torch.device) -> str:
    """'cpu', or the GPU's name as a tag like 'nvidia-h100-80gb-hbm3'."""
    if device.type == "cuda":
        return "-".join(torch.cuda.get_device_name(device).lower().split())
    return device.type


def machine_info(adapter: ModelAdapter) -> dict[str, Any]:
    """Where the numbers were measured."""
    info = {
        "platform": platform.platform(),
        "machine": platform.machine(),
        "processor": platform.processor(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": str(adapter.device),
        "dtype": str(adapter.dtype),
    }
    if adapter.device.type == "cuda":
        info["device_name"] = torch.cuda.get_device_name(adapter.device)
    return info


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


__all__ = ["GreedyMismatchError", "TunerError", "auto_grid", "load_prompts", "parse_batch_sizes", "parse_grid", "tune"]
