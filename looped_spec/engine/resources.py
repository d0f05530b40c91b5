"""What an engine allocates beside the weights: KV blocks, and the CUDA graphs of its steps or loop passes."""

from __future__ import annotations

import logging
import math

import torch

from looped_spec.execution.cuda_graph import CudaGraphRunner, batch_buckets
from looped_spec.execution.kv_cache import KVCache
from looped_spec.loop_batching import LoopPassGraphs
from looped_spec.models.adapter import ModelAdapter

logger = logging.getLogger(__name__)


def num_kv_blocks(
    adapter: ModelAdapter, max_model_len: int, max_batch_size: int, block_size: int, blocks: int | None,
    memory_gb: float | None,
) -> int:  # fmt: skip
    """`blocks` when given, else as many as `memory_gb` holds (default 2 GiB; on CUDA half the free memory), never
    more than a full batch of the longest requests needs. Too few for one request of `max_model_len` is an error."""
    # The most blocks one request holds: its KV never covers more than max_model_len tokens (admission needs room for
    # prompt + 1 < max_model_len, and a round drafts at most the tokens the request may still commit)
    given_blocks, given_memory = blocks, memory_gb
    per_request = (max_model_len + block_size - 1) // block_size
    per_block = KVCache.bytes_per_block(adapter.kv_layout, block_size, adapter.dtype)
    if blocks is None:
        if memory_gb is None:
            memory_gb = 2.0
            if adapter.device.type == "cuda":
                memory_gb = 0.5 * torch.cuda.mem_get_info(adapter.device)[0] / 2**30
        full_batch = per_request * max_batch_size
        # compared before int(): memory_gb * 2**30 is inf for a huge memory_gb (1e300), which no int holds
        blocks = full_batch if memory_gb * 2**30 >= full_batch * per_block else int(memory_gb * 2**30) // per_block
    if blocks < per_request:
        planes = adapter.kv_layout.num_planes
        if given_blocks is not None:
            source, remedy = f"num_kv_blocks={given_blocks}", f"num_kv_blocks >= {per_request}"
        else:
            label = (
                "the default 2 GiB on CPU / half the free GPU memory" if given_memory is None else "kv_cache_memory_gb"
            )
            source = f"{label}={memory_gb:.3g} GiB ({blocks} blocks)"
            remedy = f"kv_cache_memory_gb >= {math.ceil(per_request * per_block / 2**20) / 1024!r}"  # whole MiB, up
        raise ValueError(
            f"{source} cannot hold one request of max_model_len={max_model_len}: it needs {per_request} blocks of "
            f"{per_block / 2**20:.3g} MiB ({block_size} tokens in each of the model's {planes} KV planes, which its "
            f"depth D={adapter.full_depth} sets); give {remedy}, or lower max_model_len (or a depth option such as "
            "Huginn's num_steps)"
        )
    return blocks


def allocate_kv_cache(
    adapter: ModelAdapter, blocks: int, block_size: int, given_blocks: int | None, given_memory: float | None
) -> KVCache:
    """The KV cache of `blocks` blocks on the model's device. A device that cannot hold it is a ValueError naming the
    option that sized it and the GiB asked for: torch's allocator error names neither."""
    try:
        return KVCache(adapter.kv_layout, blocks, block_size, adapter.dtype, adapter.device)
    except RuntimeError as exc:  # torch.OutOfMemoryError on CUDA; the CPU allocator raises a plain RuntimeError
        cause = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    except TypeError as exc:  # torch.zeros: a size past int64, "Overflow when unpacking long long" and C++ frames
        if "Overflow" not in str(exc):
            raise
        cause = "more elements than a tensor holds"
    # raised here, not inside the handler: the allocator's error (and the half-built cache its frames hold, device
    # memory on CUDA) is not kept alive as the context of ours
    # keys and values of every block and of the scratch block (KVCache), as the allocation asked for them
    size = (blocks + 1) * KVCache.bytes_per_block(adapter.kv_layout, block_size, adapter.dtype) / 2**30
    if given_blocks is not None:
        source, remedy = f"num_kv_blocks={given_blocks}", "give fewer num_kv_blocks"
    else:  # sized by memory, never beyond what a full batch of the longest requests needs (num_kv_blocks)
        source = "the default KV cache" if given_memory is None else f"kv_cache_memory_gb={given_memory}"
        remedy = "give a lower kv_cache_memory_gb (or num_kv_blocks), or lower max_batch_size or max_model_len"
    raise ValueError(
        f"{source}: {blocks} blocks of {block_size} tokens ({size:.3g} GiB of keys and values) cannot be allocated "
        f"on {adapter.device} ({cause}); {remedy}"
    )


def wants_graphs(adapter: ModelAdapter, cuda_graphs: bool | str | None) -> bool:
    """Whether to build graphs: on CUDA unless `cuda_graphs=False`; "emulate" anywhere; `True` off CUDA is an error."""
    on_cuda = adapter.device.type == "cuda"
    if cuda_graphs is True and not on_cuda:
        raise ValueError("cuda_graphs=True needs a CUDA device (cuda_graphs='emulate' runs the path on any device)")
    return on_cuda if cuda_graphs is None else bool(cuda_graphs)


def step_graphs(
    adapter: ModelAdapter, kv: KVCache, max_model_len: int, max_batch_size: int, plan_shapes, cuda_graphs
) -> CudaGraphRunner | None:
    """The CUDA-graph runner for the step shapes the controller's plans need (`plan_shapes`), or None. "emulate" runs
    the same padded static-buffer path eagerly without capture, on any device (how the CPU tests cover it)."""
    if not wants_graphs(adapter, cuda_graphs):
        return None
    return CudaGraphRunner(adapter, kv, max_model_len, batch_buckets(max_batch_size), plan_shapes,
                           capture=cuda_graphs != "emulate")  # fmt: skip


def loop_pass_graphs(
    adapter: ModelAdapter, kv: KVCache, paged_kernel, max_model_len: int, max_batch_size: int, cuda_graphs
) -> LoopPassGraphs | None:
    """Captured loop passes (loop_batching/graphs.py), or None: they need loops that differ only in their planes and
    the paged kernel (which reads each item's plane). As for steps, `cuda_graphs=None` captures them on CUDA where
    the family and the kernel allow it (else the passes run eagerly, logged); `True` insists."""
    if not wants_graphs(adapter, cuda_graphs):
        return None
    emulate = cuda_graphs == "emulate"  # without Triton, the kernel's contract in plain torch (TorchKernelBatch)
    if not adapter.uniform_loops or not (paged_kernel or emulate):
        if not adapter.uniform_loops:
            why = (
                f"captured loop passes need a family whose loops differ only in their KV planes ({adapter.model_type}: "
                "uniform_loops = False)"
            )
        else:
            why = "captured loop passes need the paged kernel (Triton on CUDA), which is not available"
        if cuda_graphs is None:
            logger.info("engine: loop passes run eagerly: %s", why)
            return None
        raise ValueError(f"cuda_graphs={cuda_graphs!r} with batching='loop': {why}")
    return LoopPassGraphs(adapter, kv, max_model_len, max_batch_size, capture=not emulate, use_kernel=paged_kernel)
