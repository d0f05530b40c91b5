"""CUDA-graph runner: bucketing/padding logic on CPU (emulated, no capture); capture itself under `cuda`."""

from __future__ import annotations

import pytest
import torch
from conftest import FAMILIES, engine_with_graphs, fixture_dir, load

from looped_spec import LoopedSpecEngine, SamplingParams, load_adapter
from looped_spec.execution.cuda_graph import batch_buckets, context_buckets, graph_keys, pad_batch, pad_to

PROMPTS = [[5, 9, 13], [200, 1, 77, 4, 4, 19, 88, 23, 7, 150, 3], [42], [17, 18, 19, 20, 21, 22], [99, 98, 97]]
MAX_TOKENS = [12, 7, 15, 3, 10]


def test_batch_buckets_and_padding():
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(6) == [1, 2, 4, 6]
    assert batch_buckets(1) == [1]
    buckets = batch_buckets(32)
    assert [pad_batch(n, buckets) for n in (1, 3, 5, 8, 9, 17, 32)] == [1, 4, 8, 8, 16, 24, 32]
    assert pad_batch(33, buckets) is None


def test_graph_keys_share_one_loop_capture_across_loop_ranges():
    plans = [(0, 0), (2, 1), (3, 2)]
    keys = graph_keys(plans, full_depth=4, batches=[1, 8], contexts=[64], readout_graph=True)
    # decode and both drafts run one token per request; verifies run 3 and 4: one loop graph + one readout each
    assert {(k.query_len, k.stage) for k in keys} == {(q, s) for q in (1, 3, 4) for s in ("loop", "readout")}
    assert len(keys) == 2 * 3 * 2
    sizes = [k.batch * k.query_len for k in keys]
    assert sizes == sorted(sizes, reverse=True)
    assert keys[0].batch == 8 and keys[0].query_len == 4
    per_index = graph_keys(plans, full_depth=4, batches=[1], contexts=[64], uniform_loops=False, readout_graph=True)
    assert {k.stage for k in per_index} == {"loop0", "loop1", "loop2", "loop3", "readout1", "readout2", "readout4"}
    assert {k.stage for k in graph_keys(plans, 4, [1], [64])} == {"loop"}  # a readout without attention: eager


def test_with_the_paged_kernel_verify_steps_past_its_query_size_are_not_captured():
    """The kernel's tiles are sized for at most MAX_KERNEL_QUERY tokens a request (the eager runner sends longer steps
    to the reference path): captured with it, a K = 20 verify (21 tokens, x 8 heads of a GQA group) went past them.
    Such steps are not captured, so they run eagerly; without the kernel every step's shape is captured."""
    from looped_spec.execution.cuda_graph import query_lens_of
    from looped_spec.execution.paged_kernel import MAX_KERNEL_QUERY

    plans = [(0, 0), (3, 1), (MAX_KERNEL_QUERY - 1, 1), (MAX_KERNEL_QUERY, 2), (20, 1)]
    assert query_lens_of(plans) == [1, 4, MAX_KERNEL_QUERY, MAX_KERNEL_QUERY + 1, 21]
    assert query_lens_of(plans, use_kernel=True) == [1, 4, MAX_KERNEL_QUERY]
    kernel_keys = graph_keys(plans, 4, [1, 8], [64], use_kernel=True)
    assert {k.query_len for k in kernel_keys} == {1, 4, MAX_KERNEL_QUERY}


def test_context_buckets_bound_padding_by_two():
    assert context_buckets(100, 16, per_request_lengths=False) == [16, 32, 64, 112]
    assert context_buckets(65536, 16, per_request_lengths=True) == [65536]
    buckets = context_buckets(1000, 16, per_request_lengths=False)
    for context in range(1, 1001):
        padded = pad_to(context, buckets)
        assert context <= padded <= max(16, 2 * context - 1), context


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, ignore_eos=True)


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", ["off", "2,1"])
def test_emulated_graph_path_equals_eager(family, spec):
    """The padded static-buffer path (what graphs replay) gives the eager path's tokens, and frees all KV."""
    eager = LoopedSpecEngine(load(family), speculation=spec, max_batch_size=8)
    expected = [o.token_ids for o in eager.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])]
    emulated = engine_with_graphs(load(family), "emulate", speculation=spec, max_batch_size=8)
    assert emulated.runner.graphs is not None
    outs = [o.token_ids for o in emulated.generate(PROMPTS, [greedy(n) for n in MAX_TOKENS])]
    assert outs == expected
    assert emulated.num_free_blocks == emulated.kv.num_blocks


def test_emulated_graph_logits_match_eager_closely():
    adapter = load("ouro")
    engines = [engine_with_graphs(adapter, g, speculation="off") for g in (False, "emulate")]
    logits = []
    for engine in engines:
        engine.add_request(PROMPTS[1], greedy(2))
        engine.add_request(PROMPTS[0], greedy(2))
        engine.step()  # prefill (eager in both)
        requests = list(engine.scheduler.running)
        engine.scheduler.reserve_decode(requests, [0, 0])
        logits.append(engine.runner.decode(requests))
    assert torch.allclose(logits[0], logits[1], atol=1e-5)


def test_cuda_graphs_true_on_cpu_is_a_clear_error():
    with pytest.raises(ValueError, match="cuda_graphs=True needs a CUDA device"):
        LoopedSpecEngine(load("ouro"), cuda_graphs=True)


def cuda_engine(family: str, dtype: str, graphs: bool, spec="off"):
    options = {"initial_state": "zeros"} if family == "huginn" else {}
    adapter = load_adapter(fixture_dir(family), dtype=dtype, device="cuda", **options)
    return engine_with_graphs(adapter, graphs, speculation=spec, max_batch_size=8)


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("spec", ["off", "2,1", "3,1"])
def test_graph_replay_equals_eager_fp32(family, spec):
    eager = cuda_engine(family, "float32", False, spec)
    graphs = cuda_engine(family, "float32", True, spec)
    assert graphs.runner.graphs.graphs, "nothing was captured"
    for batch in (1, 3, 5):  # several padded buckets
        params = [greedy(n) for n in MAX_TOKENS[:batch]]
        a = [o.token_ids for o in eager.generate(PROMPTS[:batch], params)]
        b = [o.token_ids for o in graphs.generate(PROMPTS[:batch], params)]
        assert a == b


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_decode_logits_bitwise_fp32(family):
    """Replay equals the same padded static-shape computation run eagerly, bit for bit."""
    logits = []
    for graphs in ("emulate", True):
        engine = cuda_engine(family, "float32", graphs)
        engine.add_request(PROMPTS[1], greedy(2))
        engine.add_request(PROMPTS[0], greedy(2))
        engine.step()
        requests = list(engine.scheduler.running)
        engine.scheduler.reserve_decode(requests, [0, 0])
        logits.append(engine.runner.decode(requests).cpu())
    assert torch.equal(logits[0], logits[1])


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replay_greedy_tokens_bf16(family):
    eager = cuda_engine(family, "bfloat16", False, "2,1")
    graphs = cuda_engine(family, "bfloat16", True, "2,1")
    params = [greedy(n) for n in MAX_TOKENS]
    assert [o.token_ids for o in eager.generate(PROMPTS, params)] == [
        o.token_ids for o in graphs.generate(PROMPTS, params)
    ]


@pytest.mark.cuda
@pytest.mark.parametrize("family", FAMILIES)
def test_graph_replay_equals_eager_without_the_kernel_fp32(family, monkeypatch):
    """The reference path inside graphs: context buckets captured on first use, mid-run."""
    monkeypatch.setenv("LOOPED_SPEC_PAGED_KERNEL", "0")
    eager = cuda_engine(family, "float32", False, "2,1")
    graphs = cuda_engine(family, "float32", True, "2,1")
    assert not graphs.runner.graphs.use_kernel and len(graphs.runner.graphs.contexts) > 1
    params = [greedy(n) for n in MAX_TOKENS]
    a = [o.token_ids for o in eager.generate(PROMPTS, params)]
    b = [o.token_ids for o in graphs.generate(PROMPTS, params)]
    assert a == b
    assert graphs.runner.graphs.graphs, "nothing was captured"
