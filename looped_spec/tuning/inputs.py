"""Tuner and benchmark inputs that are neither prompts nor grids: adapter options, machine facts, `TunerError`.

Prompts (groups, files, random token ids, fingerprints) live in `looped_spec.tuning.prompt_sets`; batch sizes,
the (K, d) grid and workload phases in `looped_spec.tuning.grid`. This module imports neither of them (they
import `TunerError` from here), so the three have no import cycle.
"""

from __future__ import annotations

import json
import os
import platform
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from looped_spec.models.adapter import ModelAdapter


class TunerError(ValueError):
    """Bad tuner or benchmark input; the CLI exits with status 2.

    `looped_spec.tuning.grid.GridError` (batch sizes, grid, phases) and `looped_spec.tuning.prompt_sets.
    PromptSetError` (prompt groups, files, overlap) are TunerErrors, so ``except TunerError`` around `tune()`
    catches every bad input.
    """


def parse_adapter_options(items: Sequence[str] | None) -> dict[str, Any]:
    """["key=value", ...] -> options; values parse as JSON scalars where they can (3, 0.5, true), else strings."""
    options: dict[str, Any] = {}
    for item in items or []:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise TunerError(f"--adapter-option {item!r}: expected KEY=VALUE")
        if key in options:
            raise TunerError(f"--adapter-option {item!r}: {key} is given twice")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def hardware_tag(device: torch.device) -> str:
    """'cpu', or the GPU's name as a tag like 'nvidia-h100-80gb-hbm3'."""
    if device.type == "cuda":
        return "-".join(torch.cuda.get_device_name(device).lower().split())
    return device.type


def available_memory(device: torch.device) -> tuple[int | None, str]:
    """(bytes free for new tensors, where) on `device`: the GPU's free memory, or the host's available memory
    (Linux's MemAvailable); None where it cannot be read."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0], f"free on {device}"
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024, "of host memory available"
    except (OSError, ValueError, IndexError):
        pass
    return None, "of host memory available"


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
