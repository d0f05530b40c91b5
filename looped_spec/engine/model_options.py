"""The engine options that depend on the model: max_model_len within its positions, and the plan source of
`speculation` for its depth (the adaptive preset fitted to it). The engine builds them from the loaded model; Ray
Serve's driver checks them on the model described without its weights (`models.adapter.describe_adapter`), so a
wrong one fails before any replica loads the model.
"""

from __future__ import annotations

import logging

import torch

from looped_spec.control.controller import FixedController, make_controller
from looped_spec.engine.config import EngineConfig, SpeculativeConfig, parse_speculation
from looped_spec.models.adapter import ModelAdapter
from looped_spec.presets.lookup import preset_for, warn_if_timed_at_other_threads

logger = logging.getLogger(__name__)


def model_len(config: EngineConfig, adapter: ModelAdapter) -> int:
    """The engine's max_model_len for `adapter`: the config's, within the model's positions, else the model's."""
    limit = adapter.max_positions
    length = config.max_model_len if config.max_model_len is not None else limit
    if not 2 <= length <= limit:
        raise ValueError(f"max_model_len={config.max_model_len} must be in [2, {limit}] (the model's max positions)")
    return length


def check_model_options(config: EngineConfig, adapter: ModelAdapter) -> None:
    """Raise ValueError naming the engine option `adapter` cannot run (max_model_len, speculation, the adaptive
    preset and its options), without its weights: Ray Serve's driver asks it of `describe_adapter`'s
    weightless model before any replica loads one. A trace file is not opened."""
    model_len(config, adapter)
    build_controller(config.model_copy(update={"trace_path": None}), adapter).close()


def build_controller(config: EngineConfig, adapter: ModelAdapter) -> FixedController:
    """The plan source of `config.speculation` for `adapter` (a preset only for "adaptive")."""
    spec = parse_speculation(config.speculation)
    depth = adapter.full_depth
    preset = None
    if spec == "adaptive" and depth < 2:
        # nothing to draft with: adaptive decodes plainly, and what would steer its controller does nothing
        given = config.adaptive_options_given()
        if given:
            raise ValueError(f"{', '.join(given)}: the model runs D={depth} loop, nothing to draft with; "
                             "speculation='adaptive' decodes plainly there and runs no adaptive "
                             "controller")  # fmt: skip
        logger.info("the model runs D=%d loop: nothing to draft with, speculation='adaptive' decodes plainly",
                    depth)  # fmt: skip
    if spec == "adaptive" and depth >= 2:
        preset = preset_for(adapter, config.preset)
        if adapter.device.type == "cpu":
            warn_if_timed_at_other_threads(preset, torch.get_num_threads())
    if isinstance(spec, SpeculativeConfig):
        spec = (spec.k, spec.d, spec.measure_depths, spec.stop_margin)
    return make_controller(
        spec, depth, preset, policy=config.policy, settings=config.control, trace_path=config.trace_path
    )
