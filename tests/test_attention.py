"""The reference attention path over the paged cache: a ragged batch equals each request attended alone.

A batch that mixes one-query requests (decoding) with a long one (a prompt chunk) is split into query groups, so
the decoding rows are not padded to the chunk's length; every output must equal the request's own attention."""

from __future__ import annotations

import random

import pytest
import torch

from looped_spec.execution.attention import build_paged_context


def paged_case(context_lens: list[int], query_lens: list[int], seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    planes, num_blocks, bs, heads, kv_heads, head_dim = 2, 48, 4, 4, 2, 8
    key_cache = torch.randn(planes, num_blocks * bs, kv_heads, head_dim, generator=gen)
    value_cache = torch.randn(planes, num_blocks * bs, kv_heads, head_dim, generator=gen)
    free = list(range(num_blocks))
    rng.shuffle(free)
    tables = [[free.pop() for _ in range(-(-c // bs))] for c in context_lens]
    tokens = sum(query_lens)
    q, k, v = (torch.randn(tokens, h, head_dim, generator=gen) for h in (heads, kv_heads, kv_heads))
    return key_cache, value_cache, bs, tables, q, k, v


@pytest.mark.parametrize(
    "context_lens, query_lens, grouped",
    [
        ([9, 30, 5, 12, 7], [1, 14, 1, 1, 1], True),  # decoding rows beside a prompt chunk
        ([9, 30, 5, 12, 7], [1, 14, 3, 1, 1], True),  # and a verification
        ([9, 30, 5], [2, 3, 1], False),  # little padding: one grid
        ([9, 30, 5], [1, 1, 1], False),
    ],
)
def test_a_ragged_batch_equals_each_request_alone(context_lens, query_lens, grouped):
    key_cache, value_cache, bs, tables, q, k, v = paged_case(context_lens, query_lens)
    plane = 1
    batch_cache = (key_cache.clone(), value_cache.clone())
    ctx = build_paged_context(*batch_cache, bs, tables, context_lens, query_lens)
    assert (ctx.groups is not None) == grouped
    out = ctx.attention(plane, q, k, v)
    alone_cache = (key_cache.clone(), value_cache.clone())  # each request writes its own blocks
    start = 0
    for table, context, n in zip(tables, context_lens, query_lens):
        rows = slice(start, start + n)
        alone = build_paged_context(*alone_cache, bs, [table], [context], [n])
        expected = alone.attention(plane, q[rows], k[rows], v[rows])
        torch.testing.assert_close(out[rows], expected, rtol=1e-5, atol=1e-5)
        start += n
    for cache, alone_written, before in zip(batch_cache, alone_cache, (key_cache, value_cache)):
        assert torch.equal(cache, alone_written) and not torch.equal(cache, before)


def test_a_cuda_model_the_paged_kernel_cannot_serve_says_so_and_why(monkeypatch, caplog):
    """On CUDA the paged kernel reads decode attention in place; where it cannot (a head_dim under 16, Triton
    missing) the engine runs the slower reference path, and says so once, naming the reason. Turning it off with
    LOOPED_SPEC_PAGED_KERNEL=0 is said at info level, and on a CPU (only the reference path) nothing is said."""
    from types import SimpleNamespace

    from looped_spec.execution.model_runner import ModelRunner
    from looped_spec.execution.paged_kernel import kernel_unavailable_reason

    assert "head_dim is 8" in kernel_unavailable_reason("cuda", 8)
    assert "CUDA only" in kernel_unavailable_reason("cpu", 64)

    def runner_on(device: str, head_dim: int) -> ModelRunner:  # construction only stores what it is given
        adapter = SimpleNamespace(device=torch.device(device), full_depth=4)
        return ModelRunner(adapter, SimpleNamespace(layout=SimpleNamespace(head_dim=head_dim)))

    caplog.set_level("INFO", logger="looped_spec.execution.model_runner")
    assert not runner_on("cuda", 8).paged_kernel
    (record,) = caplog.records
    assert record.levelname == "WARNING" and "head_dim is 8" in record.getMessage()
    assert "reference path" in record.getMessage()
    caplog.clear()
    assert not runner_on("cpu", 8).paged_kernel
    assert not caplog.records
    monkeypatch.setenv("LOOPED_SPEC_PAGED_KERNEL", "0")
    assert not runner_on("cuda", 64).paged_kernel
    (record,) = caplog.records
    assert record.levelname == "INFO" and "LOOPED_SPEC_PAGED_KERNEL=0" in record.getMessage()
