"""Reading typed values out of a checkpoint's config.json, with errors that name the field.

Adapters read their dimensions through these helpers so that `n_heads: 0` or `vocab_size: "abc"`
fails at load with the field's name instead of a ZeroDivisionError or a bare `int()` error later.
"""

from __future__ import annotations

import math
from typing import Any

_MISSING = object()


def int_field(config: dict, key: str, default: Any = _MISSING, minimum: int = 1) -> int:
    """An integer field >= `minimum` (JSON floats with an integral value are accepted, as HF configs write 4.0)."""
    value = config.get(key, _MISSING)
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ValueError(f"missing field {key}")
        return default
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be an integer")
    if value < minimum:
        raise ValueError(f"{key}={value} must be >= {minimum}")
    return value


def float_field(
    config: dict, key: str, default: Any = _MISSING, positive: bool = True, name: str | None = None
) -> float:
    """A finite number (> 0 when `positive`); errors call it `name` (a nested field's path), else `key`."""
    value = config.get(key, _MISSING)
    name = name or key
    if value is _MISSING or value is None:
        if default is _MISSING:
            raise ValueError(f"missing field {name}")
        return default
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{name}={value!r} must be a finite number")
    if positive and value <= 0:
        raise ValueError(f"{name}={value} must be > 0")
    return float(value)


def bool_field(config: dict, key: str, default: bool) -> bool:
    """A JSON boolean. A string such as "false" is an error, not truthy: read with bool() it would switch the math on
    (a tied head, Nanbeige's skip_loop_final_norm) against what the file says."""
    value = config.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key}={value!r} must be true or false")
    return value


def token_ids_field(value: Any, key: str) -> list[int]:
    """None, a token id or a list of token ids (eos_token_id) -> list of non-negative ints."""
    if value is None:
        return []
    items = value if isinstance(value, list) else [value]
    for item in items:
        if not isinstance(item, int) or isinstance(item, bool) or item < 0:
            raise ValueError(f"{key}={value!r} must be a token id or a list of token ids (non-negative integers)")
    return list(items)


def rope_theta(config: dict, default: float, key: str = "rope_theta") -> float:
    """RoPE base from either config form: top-level `rope_theta` (transformers 4) or `rope_parameters`
    (transformers 5: `{"rope_theta": ..., "rope_type": "default"}`). Scaled RoPE variants are rejected."""
    params = config.get("rope_parameters")
    theta = None
    if params is not None:
        if not isinstance(params, dict):
            raise ValueError(f"rope_parameters={params!r} must be an object")
        rope_type = params.get("rope_type", params.get("type", "default"))
        if rope_type != "default":
            raise ValueError(f"rope_parameters.rope_type={rope_type!r} is not supported (only 'default')")
        unknown = sorted(set(params) - {"rope_theta", "rope_type", "type"})
        if unknown:
            raise ValueError(f"rope_parameters fields {unknown} are not supported (only rope_theta, rope_type)")
        if "rope_theta" in params:
            theta = float_field(params, "rope_theta", name="rope_parameters.rope_theta")
    top = float_field(config, key, None)
    if theta is not None and top is not None and theta != top:
        raise ValueError(f"{key}={top} disagrees with rope_parameters.rope_theta={theta}")
    if theta is not None:
        return theta
    return top if top is not None else default
