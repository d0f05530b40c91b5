"""Host-built index tensors reach the device without the host waiting for the device.

`torch.tensor(values, device="cuda")` and `.to("cuda")` copy synchronously: the host waits until the device has run
everything queued before the copy, then prepares the next launch while the device idles. The engine builds each
pass's indices on the host (positions, slots, block tables, the planes of a loop pass), so every such copy left a gap
between passes: on an H200 a captured loop pass waited on the device about eight times (docs/benchmarking.md, "The
second GPU run"). `to_device` stages the values in pinned (page-locked) host memory and copies asynchronously on the
current stream; torch's pinned-memory allocator keeps the staging block until the copy has run, and work queued after
the copy on the same stream sees its result. On other devices it is a plain tensor.
"""

from __future__ import annotations

import torch


def to_device(values, device: torch.device | str, dtype: torch.dtype | None = None) -> torch.Tensor:
    """`values` (a list or a host tensor) on `device` (as `dtype`, else torch's own choice), copied without a
    host-device wait. A pageable host tensor is staged in a fresh pinned copy, so the caller may change it at once;
    an already pinned one is copied from as it is and must stay unchanged until the device has read it."""
    if isinstance(values, torch.Tensor):
        host = values if dtype is None else values.to(dtype)
    else:
        host = torch.tensor(values, dtype=dtype)
    kind = device.type if isinstance(device, torch.device) else torch.device(device).type
    if kind == "cpu":
        return host
    if kind != "cuda":
        return host.to(device)
    if torch.cuda.is_current_stream_capturing():  # a graph would keep the staging block's address, not its values
        raise RuntimeError("to_device inside a CUDA graph capture: build a captured pass's inputs before capturing")
    return host.pin_memory().to(device, non_blocking=True)


def copy_from_host(target: torch.Tensor, host: torch.Tensor) -> None:
    """Copy a host tensor into a device buffer without the host waiting for the device (a pageable source may make
    the copy wait for the stream; a pinned one does not). As for `to_device`, a pageable source is staged in a fresh
    pinned copy; an already pinned one must stay unchanged until the copy has run."""
    if target.is_cuda:
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("copy_from_host inside a CUDA graph capture: fill a graph's buffers before replaying it")
        host = host.pin_memory()
    target.copy_(host, non_blocking=True)
