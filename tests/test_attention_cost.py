"""What attention reads follows each request's context, on the eager and the (emulated) graph path."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import FAMILIES, engine_with_graphs, load

import looped_spec.presets
from looped_spec.execution.attention import PagedContext
from looped_spec.execution.cuda_graph import batch_buckets, context_buckets, graph_keys, pad_to
from looped_spec.execution.model_runner import StepInput

MAX_MODEL_LEN = 100


@pytest.fixture
def key_reads(monkeypatch):
    """Keys per request each reference-path attention call reads (one entry per plane and call)."""
    reads: list[int] = []
    gather = PagedContext.gather

    def spy(self, plane_index):
        keys, values = gather(self, plane_index)
        reads.append(keys.shape[2])
        return keys, values

    monkeypatch.setattr(PagedContext, "gather", spy)
    return reads


def fake_request(context: int, block_size: int, offset: int = 0) -> SimpleNamespace:
    return SimpleNamespace(block_table=list(range(offset, offset + -(-context // block_size))), seed=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_graph_keys_read_follow_context_from_1_to_max_model_len(family, key_reads):
    """B=1 decode step at every context 1..max_model_len: the graph path reads the context rounded up to its
    bucket (< 2x, never max_model_len for short contexts), the eager path exactly the context; same logits."""
    engine = engine_with_graphs(
        load(family), "emulate", speculation="off", max_batch_size=4, max_model_len=MAX_MODEL_LEN
    )
    runner, bs, depth = engine.runner, engine.kv.block_size, engine.adapter.full_depth
    torch.manual_seed(0)
    engine.kv.key_cache.normal_()  # attention over random keys, so a wrong key set changes the output
    engine.kv.value_cache.normal_()
    buckets = context_buckets(MAX_MODEL_LEN, bs, per_request_lengths=False)
    loop_planes = engine.adapter.kv_layout.num_loop_planes
    for context in range(1, MAX_MODEL_LEN + 1):
        request = fake_request(context, bs)
        token = torch.tensor([7 + context % 50])
        key_reads.clear()
        step = StepInput([request], [1], [context], 0, depth, tokens=token)
        eager = runner.eager.step(step)
        eager_reads = list(key_reads)
        key_reads.clear()
        graph = runner.graphs.step(step)
        graph_reads = list(key_reads)
        assert len(graph_reads) == len(eager_reads) >= loop_planes  # one read per plane the step attends in
        assert set(eager_reads) == {context}
        assert set(graph_reads) == {pad_to(context, buckets)}, context
        assert context <= graph_reads[0] <= max(bs, 2 * context - 1)
        torch.testing.assert_close(graph.logits, eager.logits, rtol=1e-5, atol=1e-5)
        assert torch.equal(graph.logits.argmax(-1), eager.logits.argmax(-1))
        torch.testing.assert_close(graph.state, eager.state, rtol=1e-5, atol=1e-5)
    # one loop capture (+ Huginn's coda readout) per context bucket used (1 token per request, batch bucket 1)
    assert runner.graphs.num_graphs == (2 if family == "huginn" else 1) * len(buckets)


def test_ragged_batch_graph_reads_bounded_by_longest_context(key_reads):
    """A padded batch reads its longest context's bucket per request; the eager path its longest context."""
    engine = engine_with_graphs(
        load("ouro"), "emulate", speculation="off", max_batch_size=4, max_model_len=MAX_MODEL_LEN
    )
    runner, bs = engine.runner, engine.kv.block_size
    torch.manual_seed(1)
    engine.kv.key_cache.normal_()
    engine.kv.value_cache.normal_()
    contexts = [3, 40, 17]
    requests = [fake_request(c, bs, offset=8 * i) for i, c in enumerate(contexts)]
    tokens = torch.tensor([5, 6, 7])
    step = StepInput(requests, [1] * 3, contexts, 0, 4, tokens=tokens)
    eager = runner.eager.step(step)
    key_reads.clear()
    graph = runner.graphs.step(step)
    assert set(key_reads) == {64}  # bucket of 40 (the batch pads to 4 rows)
    torch.testing.assert_close(graph.logits, eager.logits, rtol=1e-5, atol=1e-5)


def shipped_presets() -> list[Path]:
    return sorted(Path(looped_spec.presets.__file__).parent.glob("*.json"))


def test_graph_count_for_shipped_presets_is_bounded():
    """Graphs per preset at max_batch_size=32: one loop graph (+ Huginn's coda readout) per (batch bucket, tokens
    per request), fewer than the one graph per loop range that came before."""
    batches = batch_buckets(32)
    rows = []
    for path in shipped_presets():
        preset = json.loads(path.read_text())
        plans = sorted({(c["k"], c["d"]) for b in preset["buckets"] for c in b["candidates"]} | {(0, 0)})
        depth = preset["full_depth"]
        coda = "huginn" in preset["model"]  # Huginn's readout attends, so it is captured too
        kernel = graph_keys(plans, depth, batches, [65536], readout_graph=coda)
        sdpa = graph_keys(plans, depth, batches, context_buckets(65536, 16, False), readout_graph=coda)
        # the previous design: one graph per (batch, tokens per request, loop range), each over max_model_len keys
        ranges = {(1, 0, depth)} | {(1, 0, d) for k, d in plans if k} | {(k + 1, d, depth) for k, d in plans if k}
        rows.append((path.stem, len(kernel), len(sdpa), len(batches) * len(ranges)))
        distinct_k = len({k for k, _ in plans if k})
        assert len(kernel) == len(batches) * (1 + distinct_k) * (2 if coda else 1)
        assert len(kernel) <= len(batches) * len(ranges)
    print("\npreset: graphs with the paged kernel / bucketed SDPA (lazily, per bucket used) / per loop range before")
    for name, kernel, sdpa, before in rows:
        print(f"  {name:16s} {kernel:4d} / {sdpa:5d} / {before:4d}")
    assert max(r[1] for r in rows) <= 2 * len(batches) * 7  # at most 6 distinct K per preset
