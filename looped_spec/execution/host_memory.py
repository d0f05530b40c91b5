"""Keep freed host memory inside the process, so the big tensors of every decode step do not page-fault.

On the CPU every loop pass allocates tensors of a few MB (the keys and values it gathers, the attention
scores) and frees them a moment later. glibc's malloc serves blocks above its mmap threshold with fresh
`mmap`s and returns them on free, and trims the heap top above its trim threshold: each step then touches
new pages and pays a page fault per 4 KiB (what that costs: docs/architecture.md, "KV cache layout"). glibc
adapts its thresholds to what was freed, so with the defaults the faults vary from run to run. Raising both
thresholds makes malloc reuse freed blocks, as an allocator such as tcmalloc or jemalloc would: the process
keeps its peak heap instead of returning it.

The engine calls `keep_freed_memory()` once when it runs on the CPU; `LOOPED_SPEC_KEEP_FREED_MEMORY=0`
in the environment leaves malloc as it is (e.g. when another allocator is preloaded).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

logger = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
#: Blocks up to this size come from the heap and are reused after free (glibc's cap for the threshold)
MMAP_THRESHOLD_BYTES = 32 * 1024 * 1024
#: The heap top is returned to the system only above this much free memory
TRIM_THRESHOLD_BYTES = 1024 * 1024 * 1024
ENV_SWITCH = "LOOPED_SPEC_KEEP_FREED_MEMORY"

_applied: bool | None = None


def keep_freed_memory() -> bool:
    """Raise glibc malloc's mmap and trim thresholds once per process; True when they are set.

    False without glibc (another C library, macOS, Windows) or when `LOOPED_SPEC_KEEP_FREED_MEMORY=0`.
    """
    global _applied
    if _applied is not None:
        return _applied
    if os.environ.get(ENV_SWITCH, "1").strip() == "0":
        logger.info("%s=0: host malloc settings left as they are", ENV_SWITCH)
        _applied = False
        return _applied
    _applied = False
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
        mallopt = getattr(libc, "mallopt", None)
    except OSError:
        mallopt = None
    if mallopt is None:
        logger.info("no glibc mallopt: host malloc settings left as they are")
        return _applied
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES) == 1
    ok = mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES) == 1 and ok
    _applied = ok
    logger.info(
        "host malloc keeps freed memory (mmap threshold %d MiB, trim threshold %d MiB): %s; %s=0 turns it off",
        MMAP_THRESHOLD_BYTES >> 20,
        TRIM_THRESHOLD_BYTES >> 20,
        "set" if ok else "mallopt refused",
        ENV_SWITCH,
    )
    return _applied
