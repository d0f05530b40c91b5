"""Offline tuner: measure acceptance (model + text) and pass cost (hardware) apart, derive a preset from both.

    looped-spec tune --model tiny-ouro --prompts tune --out presets/tiny-ouro.json

1. Acceptance (deterministic, no timing; `acceptance_pass.py`): α_d, ρ_d and every grid cell's committed tokens
   per round replayed on greedy trajectories of the tuning prompts.
2. Cost (hardware; `profile.py`): timed runner steps on a grid of shapes and interleaved rounds of a few plans,
   fitted to the pass-cost profile, and that profile's predictions checked against the rounds.
3. Preset: buckets, candidates, initial choices and thresholds from 1 + 2 (`derive.py`), plus both
   measurements (`acceptance`, `cost`), provenance with the tuning prompts' fingerprints (the benchmarks refuse
   to evaluate on them). Given a cost profile (`cost_profile=`) the tuner times nothing and is deterministic; the
   provenance's ``machine`` is then where the acceptance was measured, ``cost_machine`` where the profile was timed.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from looped_spec.control.passcost import PassCost
from looped_spec.engine.inputs import load_tokenizer, to_token_ids
from looped_spec.models.adapter import ModelAdapter, load_adapter
from looped_spec.presets.schema import AdaptiveSpecConfig, CostConfig
from looped_spec.tuning import profile
from looped_spec.tuning.acceptance_pass import acceptance_report, acceptance_variants, measure_match_bits
from looped_spec.tuning.derive import RULES, BucketModel, bucket_ranges, derive_buckets, pass_seconds
from looped_spec.tuning.grid import parse_batch_sizes, parse_grid
from looped_spec.tuning.inputs import TunerError, available_memory, hardware_tag, machine_info
from looped_spec.tuning.prompt_sets import distinct_fingerprints, load_prompts

logger = logging.getLogger(__name__)


def _progress(total: int, enabled: bool):
    from tqdm import tqdm

    return tqdm(total=total, desc="tune", disable=not enabled, dynamic_ncols=True)


def measure_cost(
    adapter: ModelAdapter,
    prompts: Sequence[Any],
    batch_sizes: Sequence[int],
    *,
    repeats: int,
    round_tokens: int,
    seed: int = 0,
    bar=None,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """(`CostConfig` data, report): steps and rounds timed, fitted, and the fit checked against the rounds."""
    steps = profile.measure_steps(adapter, repeats, seed, bar)
    plans = profile.round_plans(adapter.full_depth)
    rounds = profile.measure_rounds(adapter, prompts, batch_sizes, plans, round_tokens, repeats, seed, bar)
    cost = profile.fit_profile(adapter.full_depth, steps, rounds)
    contexts = [fb.context for fb, _ in rounds]
    report = {
        "steps_timed": len(steps),
        "rounds_timed": len(rounds),
        "round_plans": [f"{k},{d}" for k, d in plans],
        "mean_context": round(statistics.mean(contexts), 1) if contexts else 0.0,
        "validation": profile.validate(cost, rounds, adapter.full_depth),
    }
    report["validation_summary"] = summary = profile.validation_summary(report["validation"])
    if summary is None:  # too few full-shape rounds of any speculative plan at a batch size beside plain's
        logger.warning(
            "the pass-cost profile's prices of plans against plain decoding were not checked: no speculative plan "
            "ran 3 timed rounds of its full shape (raise --round-tokens or --repeats for a checked profile)"
        )
    elif not summary["trusted"]:
        logger.warning(
            "the pass-cost profile prices plans against plain decoding up to %.0f%% off its own timed rounds (%s; "
            "median %.1f%%): the machine's speed moved while it was timed, and the preset's choice between plans "
            "is that uncertain here. Time it again on a quieter machine, or with more --repeats",
            100 * summary["max_error"], summary["worst_cell"], 100 * summary["median_error"],
        )  # fmt: skip
    return cost, report


def _check_round_memory(adapter: ModelAdapter, sizes: Sequence[int], longest: int, round_tokens: int) -> None:
    """Refuse batch sizes whose timed rounds' KV caches (one engine per round plan and batch size, all held at
    once) would not fit the memory the device has free, before anything is measured."""
    plans = profile.round_plans(adapter.full_depth)
    model_len = profile.rounds_model_len(adapter, longest, round_tokens, plans)
    need = sum(profile.rounds_kv_bytes(adapter, b, model_len) for b in sizes) * len(plans)
    free, where = available_memory(adapter.device)
    if free is not None and need > free:
        raise TunerError(
            f"--batch-sizes {','.join(map(str, sizes))}: the timed rounds hold KV caches for {len(plans)} plans x "
            f"{sum(sizes)} requests of up to {model_len} tokens, {need / 2**30:.3g} GiB, more than the "
            f"{free / 2**30:.3g} GiB {where}; use smaller batch sizes"
        )


def tune(
    model: str | Path | ModelAdapter,
    batch_sizes: str | Sequence[int] = (1, 2, 4, 8, 16, 32),
    prompts: str | Sequence[Any] = "tune",
    grid: str | Sequence[tuple[int, int]] = "auto",
    *,
    acceptance_tokens: int = 96,
    num_prompts: int = 32,
    round_tokens: int = 32,
    repeats: int = 4,
    cost_profile: dict[str, Any] | None = None,
    cost_report: dict[str, Any] | None = None,
    cost_profile_source: str | None = None,
    cost_measured: str | None = None,
    cost_machine: dict[str, Any] | None = None,
    hardware: str | None = None,
    dtype: str = "auto",
    device: str = "auto",
    adapter_options: dict[str, Any] | None = None,
    margin: float = 0.03,
    seed: int = 0,
    command: str | None = None,
    progress: bool = True,
) -> tuple[AdaptiveSpecConfig, dict[str, Any]]:
    """Measure acceptance and pass cost, derive a preset; returns (validated preset, report = provenance).

    `cost_profile` (a preset's `cost` section) skips the timing: the result is then deterministic; `cost_report`
    is then that profile's measurement report and `cost_machine` the machine it was timed on, both kept in the
    provenance (`looped-spec tune --cost-from PRESET`). `seed` seeds the timed rounds' order and random token-id
    prompts (``prompts="random"``, or a group on a model without a tokenizer).
    """
    started = time.perf_counter()
    sizes = parse_batch_sizes(batch_sizes)
    for name, value, low in (
        ("acceptance_tokens", acceptance_tokens, 2),
        ("num_prompts", num_prompts, 1),
        ("round_tokens", round_tokens, 2),
        ("repeats", repeats, 1),
    ):
        if value < low:
            raise TunerError(f"{name}={value} must be >= {low}")
    if hardware is not None and not hardware.strip():  # a blank tag would be the device's, silently
        raise TunerError("hardware='': is empty; give a tag such as cpu-2core, or None for the device's")
    if isinstance(model, ModelAdapter):
        # a loaded adapter's options, dtype and device are its own: ones given here would be ignored (and the
        # provenance would record options the model never ran with)
        given = [f"{name}={value!r}" for name, value, unset in (("adapter_options", adapter_options, None),
                 ("dtype", dtype, "auto"), ("device", device, "auto")) if value not in (unset, {})]  # fmt: skip
        if given:
            raise TunerError(f"{', '.join(given)}: options for loading a model, not for a loaded ModelAdapter (give "
                             "them to load_adapter, or pass the model's path or name)")  # fmt: skip
        adapter = model
        adapter_options = dict(adapter.options)
    else:
        if adapter_options is not None and not isinstance(adapter_options, dict):
            raise TunerError(f"adapter_options: a dict of the family's options (e.g. {{'num_steps': 8}}), got "
                             f"{type(adapter_options).__name__}")  # fmt: skip
        adapter = load_adapter(model, dtype=dtype, device=device, **(adapter_options or {}))
        adapter_options = dict(adapter.options)  # as the family read them (a numpy integer is recorded as an int)
    depth = adapter.full_depth
    if depth < 2:
        given = ", ".join(f"{key}={value}" for key, value in (adapter_options or {}).items())
        # the family's own names, whatever they are; "adapter option" first, as the adapter's own errors, so the
        # command line names the flag that set them (--adapter-option)
        options = f"adapter option {given}: " if given else ""
        raise TunerError(f"{options}the model has full depth D={depth}; self-speculation needs D >= 2")
    exit_threshold = adapter.default_exit_threshold
    if exit_threshold is not None and adapter.exit_rule_can_fire(exit_threshold):
        # every request would stop early, where the counterfactual readouts have no full-depth token to agree with
        raise TunerError(
            f"{adapter.default_exit_threshold_source}={exit_threshold}: early exit cannot be tuned; the acceptance "
            "pass measures each depth's agreement with full depth, which early-exited tokens never reach (tune "
            "without it; a request still sets its own exit_threshold when served)"
        )
    cells = parse_grid(grid, depth)
    timed = cost_profile is None
    if timed:  # before loading max(sizes) prompts: even the shortest prompts' KV must fit
        _check_round_memory(adapter, sizes, 1, round_tokens)
    prompt_list, prompt_what = load_prompts(prompts, max(num_prompts, max(sizes)), adapter, seed=seed, purpose="tune")
    tokenizer = load_tokenizer(adapter.path) if any(isinstance(p, str) for p in prompt_list) else None
    tokenized = [to_token_ids(p, tokenizer, adapter.vocab_size, f"prompt {p!r}") for p in prompt_list]
    longest = max(map(len, tokenized))
    # the output tokens a request may add to its prompt, named by the flags that set them
    outputs = {f"--acceptance-tokens {acceptance_tokens}": acceptance_tokens}
    if timed:  # a timed round may draft up to the grid's largest K (+ 2: the bonus token and a margin) past them
        top_k = max(k for k, _ in cells)
        outputs[f"--round-tokens {round_tokens} + the grid's largest K {top_k} + 2"] = round_tokens + top_k + 2
    flags, output_tokens = max(outputs.items(), key=lambda item: item[1])
    if longest + output_tokens >= adapter.max_positions:
        source = f", from {Path(adapter.path) / 'config.json'}" if adapter.path else ""
        raise TunerError(
            f"prompts of up to {longest} tokens + {output_tokens} output tokens ({flags}) exceed the model's "
            f"{adapter.max_positions} positions (its max_positions{source}); use fewer output tokens or shorter prompts"
        )
    if timed:
        _check_round_memory(adapter, sizes, longest, round_tokens)
    total = num_prompts + (2 * (repeats + 1) if timed else 0)
    bar = _progress(total, progress)
    try:
        bits = measure_match_bits(adapter, prompt_list[:num_prompts], acceptance_tokens, bar)
        accept = acceptance_report(bits, cells)
        if accept["positions"] == 0:
            raise TunerError("the acceptance pass measured no generated position: nothing was drafted; no preset")
        if timed:
            cost_profile, cost_report = measure_cost(
                adapter, tokenized, sizes, repeats=repeats, round_tokens=round_tokens, seed=seed, bar=bar
            )
    finally:
        bar.close()
    assert cost_profile is not None
    if cost_report and cost_report.get("validation") and "validation_summary" not in cost_report:
        # a profile timed before the check was summed up (the shipped presets'): summed up from its cells, else the
        # report says no plan was checked against plain
        cost_report = {**cost_report, "validation_summary": profile.validation_summary(cost_report["validation"])}
    cost = PassCost(CostConfig.model_validate(cost_profile), depth)
    context = (cost_report or {}).get("mean_context") or float(longest)
    models = {
        b: BucketModel(accept["alpha"], accept["rho"], pass_seconds(cost, b, context), acceptance_variants(bits, b))
        for b in sizes
    }
    buckets, disable, decisions = derive_buckets(models, cells, bucket_ranges(sizes), margin=margin)
    now = datetime.now(timezone.utc).astimezone().isoformat(timespec="seconds")
    report = {
        "tool": "looped_spec.tuning.tuner",
        "command": command or f"looped_spec.tuning.tuner.tune({adapter.name!r}, batch_sizes={sizes}, grid={grid!r})",
        "date": now,
        "cost_measured": now if timed else cost_measured,
        "wall_seconds": round(time.perf_counter() - started, 1),
        "machine": machine_info(adapter),
        "cost_machine": machine_info(adapter) if timed else (cost_machine or {}),
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
            "fingerprints": distinct_fingerprints(prompt_list),
        },
        "settings": {
            "batch_sizes": sizes,
            "grid": [f"{k},{d}" for k, d in cells],
            "acceptance_tokens": acceptance_tokens,
            "num_prompts": num_prompts,
            "round_tokens": round_tokens if timed else None,
            "repeats": repeats if timed else None,
            "seed": seed,
            "margin": margin,
            "cost_profile": "measured" if timed else (cost_profile_source or "given"),
            "priced_at_context": round(context, 1),
        },
        "acceptance": accept,
        "cost": cost_report or {},
        "decisions": decisions,
        "rules": dict(RULES),
    }
    data = {
        "model": adapter.name,
        "model_type": adapter.model_type,
        "hardware": hardware or hardware_tag(adapter.device),
        "full_depth": depth,
        "buckets": buckets,
        "disable": disable,
        "acceptance": {"alpha": accept["alpha"], "rho": accept["rho"], "positions": accept["positions"]},
        "cost": cost_profile,
        "provenance": report,
    }
    return AdaptiveSpecConfig.parse(data, source="tuned preset"), report


__all__ = ["TunerError", "measure_cost", "tune"]
