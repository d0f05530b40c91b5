"""Finding and reading preset files (`load_preset`, `find_preset`, `read_preset_file`); the format is `schema.py`.

Shipped presets are the `<name>.json` files beside this module (the repository's `presets/` folder, installed as
the `looped_spec.presets` package), one per model. Without an explicit `preset=`, a model's preset is, in this order:

1. ``preset.json`` in the checkpoint folder (how a checkpoint carries its own preset; the test fixtures
   in ``tests/fixtures/*/`` do);
2. the shipped preset matching one of the model's names: the checkpoint folder name, the repository of a
   Hugging Face cache folder (``.../models--ByteDance--Ouro-1.4B/snapshots/<hash>`` -> ``Ouro-1.4B``),
   then config.json's ``_name_or_path``. A name matches lower-cased, first exactly (``"Ouro-1.4B"`` ->
   ``ouro-1.4b.json``), then by the longest preset name that is a prefix followed by ``-``, ``_`` or
   ``.`` (``"Ouro-1.4B-Thinking"`` -> ``ouro-1.4b.json``);
3. the family-generic ``default.json``.

Whatever depth a preset was measured at, it serves a model of another depth (Huginn's `num_steps` changes at test
time): `AdaptiveSpecConfig.for_depth` rescales its candidates and interpolates its acceptance, and the choice is
logged.

`load_preset` logs the choice and the reason (logger ``looped_spec.presets.lookup``, level INFO).
Preset files are JSON.
"""

from __future__ import annotations

import json
import logging
from importlib import resources
from pathlib import Path
from typing import Any

from looped_spec.presets.schema import AdaptiveSpecConfig, PresetError

__all__ = [
    "find_preset",
    "generic_preset",
    "list_presets",
    "load_preset",
    "match_preset_name",
    "preset_dir",
    "read_preset_file",
    "shipped_preset_path",
]

logger = logging.getLogger(__name__)

PRESET_PACKAGE = "looped_spec.presets"
GENERIC_PRESET = "default"
#: A preset file inside a checkpoint folder: that checkpoint's preset (before any shipped one).
CHECKPOINT_PRESET = "preset.json"


def preset_dir() -> Path:
    """Folder of the shipped preset files."""
    return Path(str(resources.files(PRESET_PACKAGE)))


def list_presets() -> list[str]:
    """Names (file stems) of the shipped presets, sorted."""
    return sorted(p.stem for p in preset_dir().glob("*.json"))


def shipped_preset_path(name: str) -> Path | None:
    """The shipped file for preset `name` (case-insensitive, without suffix), or None."""
    path = preset_dir() / f"{name.lower()}.json"
    return path if path.is_file() else None


def read_preset_file(path: str | Path) -> AdaptiveSpecConfig:
    """Parse and validate one preset file; every error line starts with the file's path."""
    path = Path(path)
    if not path.is_file():
        raise PresetError(f"{path}: preset file not found")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as err:
        raise PresetError(f"{path}: invalid JSON: {err}") from None
    except UnicodeDecodeError as err:  # else a bare codec error that names neither the file nor the option
        raise PresetError(f"{path}: not UTF-8 text ({err.reason} at byte {err.start}); a preset file is JSON") from None
    except OSError as err:
        raise PresetError(f"{path}: cannot read it: {err.strerror or err}") from None
    return AdaptiveSpecConfig.parse(data, source=str(path))


def match_preset_name(model_name: str) -> str | None:
    """Shipped preset name for a checkpoint folder / hub id like "ByteDance/Ouro-1.4B", or None."""
    stem = Path(str(model_name).rstrip("/\\")).name.lower()
    names = [n for n in list_presets() if n != GENERIC_PRESET]
    if stem in names:
        return stem
    prefixes = [n for n in names if stem.startswith(n) and stem[len(n) : len(n) + 1] in ("-", "_", ".")]
    return max(prefixes, key=len) if prefixes else None


def _checked(config: AdaptiveSpecConfig, full_depth: int, source: str) -> AdaptiveSpecConfig:
    """`config` fitted to depth `full_depth` (schema.py `for_depth`); a change is logged with its source."""
    fitted, note = config.for_depth(full_depth)
    if note is not None:
        logger.info("adaptive preset %s: %s", source, note)
    return fitted


def generic_preset(full_depth: int) -> AdaptiveSpecConfig:
    """The family-generic preset (`default.json`) fitted to depth `full_depth` (any D >= 1)."""
    path = shipped_preset_path(GENERIC_PRESET)
    if path is None:
        raise PresetError(f"{preset_dir()}: the generic preset {GENERIC_PRESET}.json is missing")
    return _checked(read_preset_file(path), full_depth, str(path))


def _hub_repo(folder: Path) -> str | None:
    """The repository of a Hugging Face cache snapshot folder (models--ORG--NAME/snapshots/<hash>), else None."""
    repo = folder.parent.parent.name
    if folder.parent.name != "snapshots" or not repo.startswith("models--"):
        return None
    return repo.removeprefix("models--").replace("--", "/")


def model_names(
    model_name: str, folder: str | Path | None = None, config: dict[str, Any] | None = None
) -> list[tuple[str, str]]:
    """(name, where it comes from) of every name a checkpoint goes by: the adapter's (its folder's) name, a Hugging Face
    cache snapshot's repository, config.json's `_name_or_path`."""
    names = [(str(model_name), "model name")]
    if folder is not None:
        repo = _hub_repo(Path(folder).resolve())
        if repo is not None:
            names.append((repo, "Hugging Face cache repository"))
    name_or_path = (config or {}).get("_name_or_path")
    if isinstance(name_or_path, str) and name_or_path.strip():
        names.append((name_or_path, "config.json _name_or_path"))
    return names


def is_for(preset_model: str, names: list[tuple[str, str]]) -> bool:
    """Whether a preset written for `preset_model` is for a checkpoint going by `names` (`model_names`)."""
    wanted = preset_model.lower()
    return any(
        Path(name.rstrip("/\\")).name.lower() == wanted or match_preset_name(name) == wanted for name, _ in names
    )


def find_preset(
    model_name: str, folder: str | Path | None = None, config: dict[str, Any] | None = None
) -> tuple[Path, str]:
    """The preset file for a model when none is asked for, and why it was chosen (see the module docstring).

    `model_name` is the adapter's name (the checkpoint folder name when loaded from a folder), `folder`
    the checkpoint folder (None for a model built in memory), `config` its config.json data.
    """
    if folder is not None:
        own = Path(folder) / CHECKPOINT_PRESET
        if own.is_file():
            return own, f"{CHECKPOINT_PRESET} in the checkpoint folder"
    names = model_names(model_name, folder, config)
    family = (config or {}).get("model_type")
    other_families = []  # a name that matches the preset of another family (a folder "tiny-ouro-gated" of a new one)
    for name, where in names:
        match = match_preset_name(name)
        if match is not None:
            path = shipped_preset_path(match)
            assert path is not None
            tuned_for = read_preset_file(path).model_type
            if family is not None and tuned_for is not None and tuned_for != family:
                other_families.append(f"{where} {name!r} matches {match!r}, a preset for model_type {tuned_for!r}")
                continue
            return path, f"{where} {name!r} matches the shipped preset {match!r}"
    path = shipped_preset_path(GENERIC_PRESET)
    if path is None:
        raise PresetError(f"{preset_dir()}: the generic preset {GENERIC_PRESET}.json is missing")
    if other_families:
        return path, f"{'; '.join(other_families)}, not {family!r}: the family-generic default"
    tried = ", ".join(f"{where} {name!r}" for name, where in names)
    return path, f"no shipped preset matches {tried}: the family-generic default"


def preset_path(preset: str | Path) -> tuple[Path, str]:
    """The file a `preset=` names (a file path, or a shipped preset's name), and which of the two it was."""
    path = Path(preset)
    if path.is_file():
        return path, "preset= file"
    shipped = shipped_preset_path(str(preset)) if path.suffix != ".json" else None
    if shipped is None and path.is_dir():
        # 'preset.json' quoted: the command line's rewriting of field names into flags leaves a quoted name alone
        raise PresetError(f"preset={str(preset)!r}: a directory, not a preset file (a checkpoint folder's own "
                          "'preset.json' is found when no preset is given)")  # fmt: skip
    if shipped is None:
        raise PresetError(f"preset={str(preset)!r}: no such preset file or shipped preset (shipped: "
                          f"{', '.join(list_presets())})")  # fmt: skip
    return shipped, "preset= shipped name"


def read_flagged_preset(value: str, flag: str) -> AdaptiveSpecConfig:
    """The preset a command-line flag names (a file, or a shipped preset's name), read and validated; its errors as a
    PresetError naming the flag and value once (`--cost-from x.json: full_depth: Field required; buckets: ...`), not
    the engine's keyword (`preset='x.json'`) nor the file on each line."""
    try:
        return read_preset_file(preset_path(value)[0])
    except PresetError as exc:
        lines = [line.removeprefix(f"preset={value!r}: ").removeprefix(f"{value}: ") for line in str(exc).splitlines()]
        raise PresetError(f"{flag} {value}: {'; '.join(lines)}") from None


def load_preset(
    model_name: str,
    full_depth: int,
    preset: str | Path | AdaptiveSpecConfig | None = None,
    *,
    folder: str | Path | None = None,
    config: dict[str, Any] | None = None,
) -> AdaptiveSpecConfig:
    """The preset to serve `model_name` of loop depth `full_depth` with; logs which one and why.

    `preset` wins when given: a config object, a file path, or the name of a shipped preset. Otherwise
    `find_preset(model_name, folder, config)` picks it. The result is fitted to `full_depth` (logged when that
    changes it); errors name the file.
    """
    names = model_names(model_name, folder, config)
    family = (config or {}).get("model_type")
    if isinstance(preset, AdaptiveSpecConfig):
        logger.info("adaptive preset for %s: the config object given (model %r)", model_name, preset.model)
        _warn_if_another_models(preset, names, "the config object given", family)
        return _checked(preset, full_depth, f"preset for {preset.model!r}")
    if preset is not None:
        path, reason = preset_path(preset)
    else:
        path, reason = find_preset(model_name, folder, config)
    logger.info("adaptive preset for %s: %s (%s)", model_name, path, reason)
    loaded = read_preset_file(path)
    if preset is not None and path != shipped_preset_path(GENERIC_PRESET):
        _warn_if_another_models(loaded, names, str(path), family)
    return _checked(loaded, full_depth, str(path))


def preset_for(adapter: Any, preset: str | Path | AdaptiveSpecConfig | None = None) -> AdaptiveSpecConfig:
    """The preset an engine serving `adapter` (a `ModelAdapter`) runs adaptive speculation with: `load_preset` with its
    name, depth, checkpoint folder (a preset file there) and configuration (the family it was registered as)."""
    checkpoint = {**adapter.config, "model_type": adapter.model_type}
    return load_preset(adapter.name, adapter.full_depth, preset, folder=adapter.path, config=checkpoint)


_told_threads: set[tuple[str, str, int]] = set()  # (model, hardware, threads) warned about, once a process


def warn_if_timed_at_other_threads(preset: AdaptiveSpecConfig, threads: int) -> None:
    """For an engine on a CPU running `threads` torch threads: a preset's pass-cost profile holds one thread count's
    relative prices of plans (its provenance's `cost_machine.torch_threads`); with more threads a pass's compute shrinks
    and its fixed host cost does not, so plans of more passes (speculative ones) cost relatively more than it says
    (docs/adaptive.md, "Prices on another machine"). Said once per preset and thread count. A preset whose profile came
    from another (`tune --cost-from`) keeps the profile's machine as `cost_machine`, `machine` being where its
    acceptance was measured."""
    provenance = preset.provenance if isinstance(preset.provenance, dict) else {}
    machine = provenance.get("cost_machine") or provenance.get("machine")
    timed = machine.get("torch_threads") if isinstance(machine, dict) else None
    key = (preset.model, preset.hardware, threads)
    if not isinstance(timed, int) or timed == threads or key in _told_threads:
        return
    _told_threads.add(key)
    logger.warning(
        "adaptive preset %r (%s) was timed at %d torch thread(s) and this process runs %d: its plans' relative prices "
        "are another machine state's until the price probes learn them. For a preset of this state: looped-spec tune "
        "--threads %d (README, 'Tune a preset'), or run at %d thread(s) (torch.set_num_threads, --threads)",
        preset.model, preset.hardware, timed, threads, threads, timed,
    )  # fmt: skip


def _warn_if_another_models(
    preset: AdaptiveSpecConfig, names: list[tuple[str, str]], source: str, family: str | None
) -> None:
    """A preset asked for by name or file that was tuned for another model serves it (a deliberate choice, say for a
    sibling checkpoint), but its acceptance and costs are the other model's until the online estimates take over."""
    if family is not None and preset.model_type is not None and preset.model_type != family:
        logger.warning(
            "adaptive preset %s was tuned for model %r of another family (model_type %r, not %r): its acceptance "
            "prior and pass costs are that family's until the online estimates replace them",
            source, preset.model, preset.model_type, family,
        )  # fmt: skip
    elif not is_for(preset.model, names):
        logger.warning(
            "adaptive preset %s was tuned for model %r, not %r: its acceptance prior and pass costs are that model's "
            "until the online estimates replace them (`looped-spec tune` writes one for this model)",
            source, preset.model, names[0][0],
        )  # fmt: skip
