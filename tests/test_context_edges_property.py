"""The edges of the context and of the KV cache under speculation, against plain decoding of the same requests.

Random batches of greedy requests whose prompts leave 1, 2 or a few tokens of `max_model_len` (often exactly
`max_model_len - 1`), whose `max_tokens` fill the context exactly, stop one short of it or run past it; drafts of K
up to the largest a SpeculativeConfig accepts (far more than the room left; with per-token stopping or counterfactual
readouts too) or adaptive plans; max_model_len from 2; blocks of 1 to 16 tokens; a KV cache from exactly one request
of `max_model_len` (drafts must be cut, never spill into another request's blocks, and requests get preempted right
after a round rejected drafts) to a few blocks more; prompts that begin with a whole number of blocks alike under
prefix caching; prompt chunks that end on block edges; the step engine and loop passes (the CUDA-graph runners'
padded path emulated), with and without early exit (fixed depths and the families' rules), first come first served
or by priority.

Checked: the same tokens and finish reasons as plain decoding of each request alone ("length" at the context end, as
vLLM reports it); no request's prompt and output exceed `max_model_len` (a position at or past it was never computed)
and no block table covers more; every live block table is counted by the KV cache (no block handed to two requests
unless shared by the prefix cache); every block free once all finish.

Deterministic by default (derandomized, no example database); set LOOPED_SPEC_HYPOTHESIS_EXAMPLES to explore more
examples locally.
"""

from __future__ import annotations

import gc
import os
import random
from functools import cache

import pytest
from conftest import load, make_engine
from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from test_reliability_property import RANDOM_WORKLOADS, held_blocks

from looped_spec import SamplingParams, SpeculativeConfig

EXAMPLES = int(os.environ.get("LOOPED_SPEC_HYPOTHESIS_EXAMPLES", "25"))
#: exit thresholds that exit at mixed depths on the fixtures (test_early_exit.py), for the families with a rule
THRESHOLDS = {"ouro": [0.3, 0.9], "huginn": [1e-3, 0.3]}
#: the largest K a SpeculativeConfig accepts
LARGEST_K = next(m.le for m in SpeculativeConfig.model_fields["k"].metadata if hasattr(m, "le"))


def tokens(seed: int, n: int) -> list[int]:
    """`n` tokens drawn from `seed` (one draw of the example's data, however long the prompt)."""
    return random.Random(seed).choices(range(1, 256), k=n)


@st.composite
def scenarios(draw) -> dict:
    family = draw(st.sampled_from(["ouro", "nanbeige", "huginn"]))
    depth = load(family).full_depth
    block_size = draw(st.integers(1, 5) | st.sampled_from([8, 16]))
    max_model_len = draw(st.integers(2, 24))
    per_request = -(-max_model_len // block_size)
    # exactly one request of max_model_len, or a few blocks more
    num_kv_blocks = per_request + draw(st.sampled_from([0, 0, 0, 1, 2, per_request]))
    speculation = draw(
        st.one_of(
            st.just("adaptive"),
            st.builds(
                SpeculativeConfig,
                k=st.sampled_from([1, 2, 3, 5, LARGEST_K]),
                d=st.integers(1, depth - 1),
                measure_depths=st.just(False),
                stop_margin=st.sampled_from([None, None, 0.05]),  # per-token stopping
            ),
            st.builds(  # counterfactual readouts of the committed positions (a measured round drafts every k)
                SpeculativeConfig,
                k=st.sampled_from([1, 2, 3, 5, LARGEST_K]),
                d=st.integers(1, depth - 1),
                measure_depths=st.just(True),
            ),
        )
    )
    # early exit: a rule per request (fixed depths, which every family has), skip or select
    early_exit = draw(st.sampled_from([None, None, "skip", "select"]))
    # a shared beginning of whole blocks (prefix caching has whole blocks to share)
    shared = tokens(draw(st.integers(0, 2**16)), block_size) * max(1, (max_model_len // 2) // block_size)
    requests = []
    for _ in range(draw(st.integers(2, 5))):
        # the tokens the prompt leaves: one to three, any, or most (a short prompt whose output grows the most)
        room = draw(
            st.sampled_from([1, 2, 3])
            | st.integers(1, max_model_len - 1)
            | st.integers(max_model_len // 2, max_model_len - 1)
        )
        room = min(room, max_model_len - 1)
        length = max_model_len - room
        start = shared[:length] if draw(st.booleans()) else []
        prompt = start + tokens(draw(st.integers(0, 2**16)), length - len(start))
        max_tokens = draw(st.sampled_from([room, room, room + 1, max(1, room - 1), 16]) | st.integers(1, room + 3))
        exit_at_step = exit_threshold = None
        if early_exit is not None:  # a fixed exit depth, or the family's own rule where it has one
            if family in THRESHOLDS and draw(st.booleans()):
                exit_threshold = draw(st.sampled_from(THRESHOLDS[family]))
            else:
                exit_at_step = draw(st.integers(1, depth))
        requests.append({"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": draw(st.booleans()),
                         "exit_at_step": exit_at_step, "exit_threshold": exit_threshold,
                         "priority": draw(st.integers(-1, 1))})  # fmt: skip
    batching = draw(st.sampled_from(["step", "loop"]))
    # the CUDA-graph runner's padded static-buffer path (captured loop passes need loops that differ only in planes)
    graphs = draw(st.sampled_from([False, "emulate"])) if batching == "step" or load(family).uniform_loops else False
    return {
        "family": family,
        "batching": batching,
        "cuda_graphs": graphs,
        "max_pass_positions": draw(st.sampled_from([None, None, 1, 4])) if batching == "loop" else None,
        "speculation": speculation,
        "early_exit": early_exit or "skip",
        "block_size": block_size,
        "max_model_len": max_model_len,
        "num_kv_blocks": num_kv_blocks,
        # prompt chunks of whole blocks (ending on block edges) or not
        "max_num_batched_tokens": draw(st.sampled_from([block_size, 2 * block_size]) | st.integers(1, 12)),
        "prefix_caching": draw(st.booleans()),
        # which request is preempted when blocks run out: the latest arrival, or by (priority, arrival)
        "scheduling_policy": draw(st.sampled_from(["fcfs", "priority"])),
        "max_batch_size": draw(st.integers(1, 4)),
        "requests": requests,
    }


def scenario_of(family: str, batching: str, speculation, prompts: list[list[int]], max_tokens: int, **options) -> dict:
    """A scenario written out (the examples every run starts with): greedy requests ignoring eos, no early exit."""
    requests = [{"prompt": p, "max_tokens": max_tokens, "ignore_eos": True, "exit_at_step": None,
                 "exit_threshold": None, "priority": 0} for p in prompts]  # fmt: skip
    defaults = {"cuda_graphs": False, "max_pass_positions": None, "early_exit": "skip", "prefix_caching": False,
                "scheduling_policy": "fcfs", "max_batch_size": len(prompts)}  # fmt: skip
    return defaults | options | {"family": family, "batching": batching, "speculation": speculation,
                                 "requests": requests}  # fmt: skip


#: a cache of exactly one request of max_model_len (8 blocks of 2): the short prompts outgrow it together, so a request
#: is preempted right after a round whose drafts were rejected
TIGHT = dict(block_size=2, max_model_len=16, num_kv_blocks=8, max_num_batched_tokens=4)
TIGHT_PROMPTS = [[5, 9], [7, 3, 1], list(range(11, 26))]
#: prompts of max_model_len - 1 tokens beginning with 2 whole blocks alike, computed in chunks of a block, K = 64
FULL = dict(block_size=4, max_model_len=12, num_kv_blocks=6, max_num_batched_tokens=4, prefix_caching=True)
FULL_PROMPTS = [[9, 8, 7, 6, 5, 4, 3, 2, 1, 10, 11], [9, 8, 7, 6, 5, 4, 3, 2, 12, 13, 14], [9, 8, 7, 6, 5, 4, 3, 2]]


def params_of(spec: dict) -> SamplingParams:
    return SamplingParams(max_tokens=spec["max_tokens"], temperature=0.0, ignore_eos=spec["ignore_eos"],
                          exit_at_step=spec["exit_at_step"], exit_threshold=spec["exit_threshold"])  # fmt: skip


@cache
def plain_engine(family: str, max_model_len: int, early_exit: str):
    return make_engine(family, max_model_len=max_model_len, max_batch_size=1, early_exit=early_exit)


@cache
def plain(family: str, max_model_len: int, early_exit: str, prompt: tuple[int, ...], params_json: str):
    """Plain decoding of one request alone: its tokens and finish reason."""
    params = SamplingParams.model_validate_json(params_json)
    out = plain_engine(family, max_model_len, early_exit).generate(list(prompt), params)[0]
    return tuple(out.token_ids), out.finish_reason


@pytest.mark.slow
@settings(RANDOM_WORKLOADS, max_examples=EXAMPLES)
@given(scenarios())
@example(scenario_of("ouro", "step", SpeculativeConfig(k=3, d=1), TIGHT_PROMPTS, 16, **TIGHT))
@example(scenario_of("huginn", "loop", SpeculativeConfig(k=3, d=1), TIGHT_PROMPTS, 16, **TIGHT))
@example(scenario_of("ouro", "loop", SpeculativeConfig(k=LARGEST_K, d=2), FULL_PROMPTS, 16, **FULL))
@example(scenario_of("nanbeige", "step", "adaptive", FULL_PROMPTS, 4, **FULL))
def test_drafts_at_the_edges_of_the_context_and_the_kv_cache_equal_plain_decoding(scenario):
    family, max_model_len, block_size = scenario["family"], scenario["max_model_len"], scenario["block_size"]
    engine = make_engine(
        family, speculation=scenario["speculation"], batching=scenario["batching"],
        early_exit=scenario["early_exit"], block_size=block_size, num_kv_blocks=scenario["num_kv_blocks"],
        max_model_len=max_model_len, max_num_batched_tokens=scenario["max_num_batched_tokens"],
        prefix_caching=scenario["prefix_caching"], max_batch_size=scenario["max_batch_size"],
        cuda_graphs=scenario["cuda_graphs"], max_pass_positions=scenario["max_pass_positions"],
        scheduling_policy=scenario["scheduling_policy"],
    )  # fmt: skip
    most_blocks = -(-max_model_len // block_size)
    try:
        ranked = scenario["scheduling_policy"] == "priority"
        specs = {engine.add_request(s["prompt"], params_of(s), priority=s["priority"] if ranked else 0): s
                 for s in scenario["requests"]}  # fmt: skip
        finished = {}
        for _ in range(2000):
            if not engine.has_unfinished_requests():
                break
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in finished, f"{out.request_id} reported finished twice"
                    finished[out.request_id] = out
            assert engine.num_free_blocks + held_blocks(engine) == engine.kv.num_blocks, "KV blocks leaked"
            for request in engine.scheduler.running:
                assert len(request.block_table) <= most_blocks, "a block table covers more than max_model_len"
        assert not engine.has_unfinished_requests(), "the engine is wedged"
        assert sorted(finished) == sorted(specs)
        assert engine.num_free_blocks == engine.kv.num_blocks
        for request_id, out in finished.items():
            spec = specs[request_id]
            total = len(spec["prompt"]) + len(out.token_ids)
            assert total <= max_model_len, f"{request_id}: {total} tokens, max_model_len={max_model_len}"
            if out.finish_reason == "length" and len(out.token_ids) < spec["max_tokens"]:
                assert total == max_model_len, f"{request_id}: 'length' at {total} of {max_model_len} tokens"
            expected = plain(family, max_model_len, scenario["early_exit"], tuple(spec["prompt"]),
                             params_of(spec).model_dump_json())  # fmt: skip
            assert (tuple(out.token_ids), out.finish_reason) == expected, request_id
        event(f"preempted: {engine.scheduler.num_preemptions > 0}")
        event(f"speculative rounds: {engine.stats.num_spec_rounds > 0}")
        event(f"prefix cache hits: {engine.stats.num_prefix_cache_hits > 0}")
    finally:
        gc.collect()  # engines hold their KV cache in reference cycles: free earlier examples' engines
