"""The KV plan a family declares: which planes its keys and values need (the execution layer allocates them)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class KVLayout:
    """Shape of the KV cache a family needs: one plane per (loop, layer), and any planes written once per
    token (Huginn's prelude and coda) in the other `num_planes - num_loop_planes`."""

    num_planes: int
    num_kv_heads: int
    head_dim: int
    num_loop_planes: int  # planes written once per loop iteration (D x layers per loop)
    first_loop_plane: int = field(default=0, kw_only=True)  # loop planes are contiguous, loop after loop, from here
