"""Reading Hugging Face style checkpoint folders safely (safetensors only)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open


class CheckpointError(ValueError):
    """A checkpoint folder or file cannot be used; the message names the file and tensor."""


def read_config(folder: str | Path) -> dict:
    """Load `config.json` from a checkpoint folder, with errors that name the file."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise CheckpointError(f"checkpoint folder {folder!s} does not exist or is not a directory")
    if not path.is_file():
        raise CheckpointError(f"{path}: missing config.json; a checkpoint folder needs config.json + safetensors")
    try:
        config = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from exc
    if not isinstance(config, dict):
        raise CheckpointError(f"{path}: expected a JSON object")
    return config


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc})") from exc
        files = sorted({folder / name for name in weight_map.values()})
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index}: names shard {file.name}, which is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickles:
        raise CheckpointError(
            f"{folder}: only pickle weights found ({', '.join(pickles)}); looped-spec loads safetensors only "
            "(pickle can run arbitrary code). Convert the checkpoint to safetensors first."
        )
    raise CheckpointError(f"{folder}: no model.safetensors, model.safetensors.index.json or *.safetensors file")


def read_tensors(folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Path]]:
    """Read every tensor of a checkpoint folder. Returns (tensors, tensor name -> file)."""
    tensors: dict[str, torch.Tensor] = {}
    origin: dict[str, Path] = {}
    for file in _weight_files(Path(folder)):
        try:
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():
                    if name in tensors:
                        raise CheckpointError(f"{file}: tensor {name} also stored in {origin[name].name}")
                    tensors[name] = handle.get_tensor(name)
                    origin[name] = file
        except CheckpointError:
            raise
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{file}: cannot read safetensors file ({exc})") from exc
    return tensors, origin


@dataclass(frozen=True)
class TensorSpec:
    """One tensor the family expects: its shape, and whether it may be absent or is ignored."""

    shape: tuple[int, ...]
    optional: bool = False
    ignored: bool = False  # known harmless extras (e.g. a stored RoPE buffer): accepted, not used


def check_tensors(
    tensors: dict[str, torch.Tensor],
    specs: dict[str, TensorSpec],
    origin: dict[str, Path],
    folder: str | Path,
) -> dict[str, torch.Tensor]:
    """Check names and shapes against the family's spec; return the used tensors."""
    missing = [n for n, s in specs.items() if n not in tensors and not s.optional]
    if missing:
        shown = ", ".join(missing[:8]) + (f" (+{len(missing) - 8} more)" if len(missing) > 8 else "")
        raise CheckpointError(f"{folder}: missing tensor(s) {shown}")
    unexpected = sorted(n for n in tensors if n not in specs)
    if unexpected:
        shown = ", ".join(unexpected[:8]) + (f" (+{len(unexpected) - 8} more)" if len(unexpected) > 8 else "")
        raise CheckpointError(f"{folder}: unexpected tensor(s) {shown} (file {origin[unexpected[0]].name})")
    used: dict[str, torch.Tensor] = {}
    for name, spec in specs.items():
        if name not in tensors or spec.ignored:
            continue
        actual = tuple(tensors[name].shape)
        if actual != spec.shape:
            raise CheckpointError(
                f"{origin[name]}: tensor {name} has shape {list(actual)}, expected {list(spec.shape)} from config.json"
            )
        used[name] = tensors[name]
    return used


def resolve_dtype(dtype: str | torch.dtype, config: dict) -> torch.dtype:
    """Map 'auto' | 'float32' | 'bfloat16' | 'float16' | torch.dtype to a torch dtype."""
    if isinstance(dtype, torch.dtype):
        return dtype
    names = {
        "float32": torch.float32,
        "fp32": torch.float32,
        "bfloat16": torch.bfloat16,
        "bf16": torch.bfloat16,
        "float16": torch.float16,
        "fp16": torch.float16,
        "half": torch.float16,
        "float": torch.float32,
    }
    if dtype == "auto":
        dtype = str(config.get("torch_dtype") or config.get("dtype") or "float32")
    if dtype not in names:
        raise ValueError(f"dtype {dtype!r} is not supported; use one of auto, float32, bfloat16, float16")
    return names[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' picks CUDA when available, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)
