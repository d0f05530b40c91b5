"""Reading Hugging Face style checkpoint folders safely (safetensors only)."""

from __future__ import annotations

import json
import re
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


_SHARD = re.compile(r"model-(\d+)-of-(\d+)\.safetensors")


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()), key=str)  # a name of another type: _shard_in_folder names it
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc})") from exc
        files = [_shard_in_folder(folder, index, name) for name in names]
        for file in files:
            if not file.is_file():
                raise CheckpointError(f"{index}: names shard {file.name}, which is missing")
        return files
    single = folder / "model.safetensors"
    if single.is_file():
        return [single]
    shards = _complete_shard_set(folder)
    if shards:
        return shards
    pickles = sorted(p.name for p in folder.glob("*.bin")) + sorted(p.name for p in folder.glob("*.pt"))
    if pickles:
        raise CheckpointError(
            f"{folder}: only pickle weights found ({', '.join(pickles)}); looped-spec loads safetensors only "
            "(pickle can run arbitrary code). Convert the checkpoint to safetensors first."
        )
    others = sorted(p.name for p in folder.glob("*.safetensors"))
    found = ""
    if others:
        listed = others[0] if len(others) == 1 else f"{', '.join(others[:-1])} and {others[-1]}"
        which = {1: "which is not", 2: "neither of which is"}.get(len(others), "none of which is")
        found = f" (found only {listed}, {which} a weights file name looped-spec reads)"
    raise CheckpointError(
        f"{folder}: no model.safetensors, model.safetensors.index.json or model-XXXXX-of-XXXXX.safetensors shards"
        + found
    )


def _shard_in_folder(folder: Path, index: Path, name: object) -> Path:
    """A shard named by the index: a plain file name inside the checkpoint folder, never a path out of it."""
    if not isinstance(name, str) or not name or Path(name).name != name or name in (".", ".."):
        raise CheckpointError(f"{index}: shard name {name!r} is not a file name inside the checkpoint folder")
    file = folder / name
    if file.resolve().parent != folder.resolve():  # e.g. a symlink pointing elsewhere
        raise CheckpointError(f"{index}: shard {name} resolves outside the checkpoint folder")
    return file


def _complete_shard_set(folder: Path) -> list[Path]:
    """`model-0000i-of-0000N.safetensors` files without an index: all N of them, or an error naming the gap."""
    found = {}
    for file in sorted(folder.glob("*.safetensors")):
        match = _SHARD.fullmatch(file.name)
        if match is not None:
            found[(int(match.group(1)), int(match.group(2)))] = file
    if not found:
        return []
    totals = {total for _, total in found}
    total = totals.pop()
    expected = {(i, total) for i in range(1, total + 1)}
    if totals or set(found) != expected:
        names = ", ".join(f.name for f in found.values())
        raise CheckpointError(f"{folder}: incomplete or mixed shard set without an index ({names})")
    return [found[key] for key in sorted(expected)]


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
        stored = tensors[name].dtype
        if not stored.is_floating_point:  # loading casts it to the model's dtype: integers or booleans are no weights
            raise CheckpointError(
                f"{origin[name]}: tensor {name} has dtype {str(stored).removeprefix('torch.')}, "
                "expected a floating-point dtype"
            )
        used[name] = tensors[name]
    return used


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


def resolve_dtype(dtype: str | torch.dtype, config: dict, config_path: str = "config.json") -> torch.dtype:
    """Map 'auto' | 'float32' | 'bfloat16' | 'float16' | one of those torch dtypes to a torch dtype. 'auto' reads
    config.json's torch_dtype (or dtype); an unsupported value there is an error naming that field, not dtype='auto'."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype={dtype} is not supported; use torch.float32, torch.bfloat16 or torch.float16")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"dtype={dtype!r} must be a string or a torch dtype")
    if dtype == "auto":
        field = next((key for key in ("torch_dtype", "dtype") if config.get(key)), None)
        if field is None:
            return torch.float32
        if str(config[field]) not in _DTYPES:
            raise CheckpointError(
                f"{config_path}: {field}={config[field]!r} is not supported, and dtype='auto' follows it; "
                "pass dtype float32, bfloat16 or float16"
            )
        dtype = str(config[field])
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r}: not supported; use one of auto, float32, bfloat16, float16")
    return _DTYPES[dtype]


def resolve_device(device: str | torch.device) -> torch.device:
    """'auto' picks CUDA when available, else CPU. A CUDA device without CUDA is an error, not a fallback."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if not isinstance(device, (str, torch.device)):
        raise TypeError(f"device={device!r} must be a string or a torch.device")
    try:
        resolved = torch.device(device)
    except RuntimeError as exc:
        raise ValueError(f"device={device!r} is not a device ({exc})") from exc
    if resolved.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device={device!r}, but this torch build has no usable CUDA device; use device='cpu'")
    if resolved.type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported; use 'auto', 'cpu' or 'cuda[:N]'")
    return resolved
