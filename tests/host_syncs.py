"""Count, by call site in the package, the calls that make the host wait for a CUDA device, on any device.

On a GPU a host-to-device copy from a list or a pageable host tensor (`torch.tensor(..., device=...)`, a blocking
`.to(device)`, indexing with a Python list) synchronizes the stream, and so does every read of a device tensor on the
host (`.tolist()`, `.item()`, `bool(t)`, `.nonzero()`): the device then idles while the host prepares the next
launch. On the CPU these calls cost nothing special, so a CPU test cannot time them; it counts them instead. Calls
made by `to_device` (an asynchronous copy on CUDA) and by the paged kernel's torch stand-in (`TorchKernelBatch`, which
exists only off the GPU) are not counted. Assigning a host tensor into a device slice is not seen (on the CPU every
tensor is a host tensor).
"""

from __future__ import annotations

import contextlib
import traceback
from collections import Counter

import torch

NOT_COUNTED = ("execution/transfers.py", "execution/paged_kernel.py")  # relative to the package
HOST_READS = ("item", "tolist", "__bool__", "__int__", "__float__", "nonzero", "cpu", "numpy")


def _site() -> str | None:
    for frame in reversed(traceback.extract_stack()[:-2]):  # not this function and the patched call
        for root in ("/looped_spec/", "/adapters/"):  # the package, and the family adapters linked into it
            if root in frame.filename:
                path = frame.filename.split(root)[-1]
                return None if path.startswith(NOT_COUNTED) else f"{root.strip('/')}/{path}:{frame.lineno}"
    return None


def _list_index(index) -> bool:
    parts = index if isinstance(index, tuple) else (index,)
    return any(isinstance(part, list) for part in parts)


def _is_device(x) -> bool:
    return isinstance(x, (torch.device, str)) and not isinstance(x, torch.dtype)


@contextlib.contextmanager
def counting_host_waits():
    """Yields two Counters, `copies` (blocking host-to-device copies) and `reads` (device reads on the host), keyed by
    call site, filled while the block runs."""
    copies, reads = Counter(), Counter()
    patches = []

    def patch(owner, name, counter, applies):
        original = getattr(owner, name)

        def counted(*args, **kwargs):
            if applies(*args, **kwargs):
                site = _site()
                if site is not None:
                    counter[f"{name} {site}"] += 1
            return original(*args, **kwargs)

        patches.append((owner, name, original))
        setattr(owner, name, counted)

    for factory in ("tensor", "as_tensor"):
        patch(torch, factory, copies, lambda *a, **k: k.get("device") is not None)
    patch(torch.Tensor, "to", copies, lambda self, *a, **k: not k.get("non_blocking")
          and (any(_is_device(x) for x in a) or "device" in k))  # fmt: skip
    for name in HOST_READS:
        patch(torch.Tensor, name, reads, lambda *a, **k: True)
    # indexing a device tensor with a Python list copies the index to the device, and waits
    patch(torch.Tensor, "__getitem__", copies, lambda self, index, *a: _list_index(index))
    patch(torch.Tensor, "__setitem__", copies, lambda self, index, *a: _list_index(index))
    try:
        yield copies, reads
    finally:
        for owner, name, original in reversed(patches):
            setattr(owner, name, original)
