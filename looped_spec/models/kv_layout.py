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

    def __post_init__(self) -> None:
        for name in ("num_planes", "num_kv_heads", "head_dim", "num_loop_planes", "first_loop_plane"):
            value = getattr(self, name)
            if (
                isinstance(value, bool)
                or not isinstance(value, int)
                or value < (0 if name == "first_loop_plane" else 1)
            ):
                raise ValueError(
                    f"KVLayout.{name}={value!r} must be an integer >= {0 if name == 'first_loop_plane' else 1}"
                )
        if self.first_loop_plane + self.num_loop_planes > self.num_planes:
            raise ValueError(
                f"KVLayout: loop planes {self.first_loop_plane}..{self.first_loop_plane + self.num_loop_planes - 1} "
                f"(first_loop_plane + num_loop_planes) do not fit in num_planes={self.num_planes}"
            )
