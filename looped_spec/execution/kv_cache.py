"""Paged KV cache with one plane per (loop, layer) and once-per-token planes.

Every plane stores the same token positions, so one block table per request addresses all
planes (as one table addresses all layers in vLLM); a plane's storage is
`[num_blocks * block_size, kv_heads, head_dim]`. Rolling back rejected draft positions is
`truncate`: blocks past the kept length go back to the free list, and stale entries inside the
last kept block are overwritten before they are read again.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from looped_spec.execution.transfers import to_device
from looped_spec.models.kv_layout import KVLayout


class KVCache:
    """Block allocator plus per-plane key/value storage."""

    def __init__(
        self, layout: KVLayout, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.layout = layout
        self.num_blocks = num_blocks  # blocks requests can hold
        self.block_size = block_size
        self.scratch_block = num_blocks  # one extra block that padding rows (CUDA graphs) write to
        shape = (layout.num_planes, (num_blocks + 1) * block_size, layout.num_kv_heads, layout.head_dim)
        self.key_cache = torch.zeros(shape, dtype=dtype, device=device)  # [planes, slots, kv_heads, head_dim]
        self.value_cache = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))  # pop() hands out low ids first

    @staticmethod
    def bytes_per_block(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * layout.num_planes * block_size * layout.num_kv_heads * layout.head_dim * elem

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, table: list[int], num_tokens: int) -> int:
        """Blocks `table` must gain to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.extra_blocks(table, num_tokens) <= len(self._free)

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks so `table` holds `num_tokens` tokens (all or nothing)."""
        need = self.extra_blocks(table, num_tokens)
        if need > len(self._free):  # a caller bug: the scheduler checks can_grow (and preempts) first
            raise RuntimeError(f"KV cache: need {need} blocks, {len(self._free)} free")
        for _ in range(need):
            table.append(self._free.pop())

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Keep blocks for the first `num_tokens` tokens; free the rest."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())

    def free(self, table: list[int]) -> None:
        self.truncate(table, 0)

    def copy_planes(self, src_planes: Sequence[int], dst_planes: Sequence[int], slots: torch.Tensor) -> None:
        """Keys/values of `slots` in `src_planes` copied into `dst_planes` (same length, plane by plane)."""
        src = to_device(list(src_planes), self.key_cache.device)[:, None]
        dst = to_device(list(dst_planes), self.key_cache.device)[:, None]
        slots = slots[None, :]
        self.key_cache[dst, slots] = self.key_cache[src, slots]
        self.value_cache[dst, slots] = self.value_cache[src, slots]

    def copy_entries(self, src_planes: torch.Tensor, dst_planes: torch.Tensor, slots: torch.Tensor) -> None:
        """Entry i: the keys/values of slot `slots[i]` in plane `src_planes[i]` copied into plane `dst_planes[i]`."""
        self.key_cache[dst_planes, slots] = self.key_cache[src_planes, slots]
        self.value_cache[dst_planes, slots] = self.value_cache[src_planes, slots]

    def release(self) -> None:
        """Give the storage back (a closed engine): no block can be handed out afterwards."""
        empty = self.key_cache.new_empty(0)
        self.key_cache, self.value_cache = empty, empty.clone()
        self._free = []
        self.num_blocks = 0
