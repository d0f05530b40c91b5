"""Paged KV cache with one plane per (loop, layer) and once-per-token planes.

Every plane stores the same token positions, so one block table per request addresses all
planes (as one table addresses all layers in vLLM); a plane's storage is
`[num_blocks * block_size, kv_heads, head_dim]`. Rolling back rejected draft positions is
`truncate`: blocks past the kept length go back to the free list, and stale entries inside the
last kept block are overwritten before they are read again.

Prefix caching (docs/architecture.md, "Prefix caching"): a full block whose KV is final can be registered under a
digest of every token up to its end; requests whose tokens start the same way then share that block (counted
references), and a registered block nobody holds stays free but findable until it is handed out again, least
recently freed first. Two requests that computed the same prefix at once (admitted before either registered it)
each register their copy: the prefix stays findable while any copy is, as in vLLM (a hash maps to every block of
it).
"""

from __future__ import annotations

from collections import OrderedDict
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
        # free blocks that still hold a registered prefix, least recently freed first: handed out after `_free`
        self._cached_free: OrderedDict[int, None] = OrderedDict()
        self._refs = [0] * num_blocks  # block tables holding each block
        # prefix digest -> the blocks holding that prefix's last block (more than one where it was computed twice)
        self._blocks_of: dict[bytes, dict[int, None]] = {}
        self._digest_of: dict[int, bytes] = {}

    @staticmethod
    def bytes_per_block(layout: KVLayout, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * layout.num_planes * block_size * layout.num_kv_heads * layout.head_dim * elem

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (registered prefixes among them: handing one out forgets its copy of its prefix)."""
        return len(self._free) + len(self._cached_free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks registered under a prefix digest (held or free)."""
        return len(self._digest_of)

    def blocks_for(self, num_tokens: int) -> int:
        return (num_tokens + self.block_size - 1) // self.block_size

    def extra_blocks(self, table: list[int], num_tokens: int) -> int:
        """Blocks `table` must gain to hold `num_tokens` tokens."""
        return max(0, self.blocks_for(num_tokens) - len(table))

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.extra_blocks(table, num_tokens) <= self.num_free_blocks

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Append blocks so `table` holds `num_tokens` tokens (all or nothing)."""
        need = self.extra_blocks(table, num_tokens)
        if need > self.num_free_blocks:  # a caller bug: the scheduler checks can_grow (and preempts) first
            raise RuntimeError(f"KV cache: need {need} blocks, {self.num_free_blocks} free")
        for _ in range(need):
            if self._free:
                block = self._free.pop()
            else:  # the least recently freed registered block: its copy of its prefix is forgotten
                block = self._cached_free.popitem(last=False)[0]
                self._forget(block)
            self._refs[block] = 1
            table.append(block)

    def truncate(self, table: list[int], num_tokens: int) -> None:
        """Keep blocks for the first `num_tokens` tokens; give back the rest (a shared block stays with its other
        holders)."""
        keep = self.blocks_for(num_tokens)
        while len(table) > keep:
            block = table.pop()
            self._refs[block] -= 1
            if self._refs[block] == 0:
                if block in self._digest_of:
                    self._cached_free[block] = None
                else:
                    self._free.append(block)

    def free(self, table: list[int]) -> None:
        self.truncate(table, 0)

    # ----- prefix caching -----
    def cached_prefix(self, digests: Sequence[bytes]) -> list[int]:
        """The blocks registered under the longest run of `digests` from the first (one block per digest)."""
        blocks = []
        for digest in digests:
            copies = self._blocks_of.get(digest)
            if not copies:
                break
            # a held copy first: sharing it leaves the free blocks as they are (a free copy stays findable)
            blocks.append(next((block for block in copies if self._refs[block]), next(iter(copies))))
        return blocks

    def num_free_among(self, blocks: Sequence[int]) -> int:
        """How many of `blocks` no request holds (sharing them takes them off the free blocks)."""
        return sum(1 for block in blocks if self._refs[block] == 0)

    def share(self, table: list[int], blocks: Sequence[int]) -> None:
        """Append registered `blocks` (from `cached_prefix`) to an empty `table`: it holds them with their other
        holders."""
        if table:
            raise RuntimeError("KV cache: a cached prefix starts a block table")
        for block in blocks:
            if self._refs[block] == 0:
                del self._cached_free[block]
            self._refs[block] += 1
            table.append(block)

    def register(self, block: int, digest: bytes) -> None:
        """`block` (full, its KV final in every plane) holds the prefix `digest` names. A prefix another block
        already registered gains a copy (found while any copy is); a block registers one prefix."""
        if block in self._digest_of:
            return
        self._blocks_of.setdefault(digest, {})[block] = None
        self._digest_of[block] = digest

    def _forget(self, block: int) -> None:
        """`block` (being handed out) no longer holds its prefix; the prefix's other copies still do."""
        digest = self._digest_of.pop(block)
        copies = self._blocks_of[digest]
        del copies[block]
        if not copies:
            del self._blocks_of[digest]

    def holders(self, block: int) -> int:
        """How many block tables hold `block`."""
        return self._refs[block]

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
        self._cached_free.clear()
        self._blocks_of.clear()
        self._digest_of.clear()
        self.num_blocks = 0
