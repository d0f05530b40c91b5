"""A decode round's KV reservation (`Scheduler.reserve_decode`) against the two-phase reference it shortcuts when
everything fits: one token each in rank order (preempting the latest arrival when blocks run out), then each
request's drafts, cut until they fit. The same requests kept, the same drafts, the same blocks held and freed."""

from __future__ import annotations

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from looped_spec.engine.scheduler import Scheduler
from looped_spec.execution.kv_cache import KVCache
from looped_spec.models.kv_layout import KVLayout
from looped_spec.request import Request, RequestStatus
from looped_spec.sampling_params import SamplingParams

BLOCK = 2


def reference_reserve(scheduler: Scheduler, requests: list[Request], wanted_k: list[int]):
    """The reservation written out in its two phases, with every check."""
    for request in sorted(requests, key=scheduler._rank):
        if request.status is RequestStatus.RUNNING:
            scheduler._grow_or_preempt(request, request.num_computed + 1)
    kept = [r for r in requests if r.status is RequestStatus.RUNNING]
    wanted = {id(r): k for r, k in zip(requests, wanted_k)}
    drafts = {}
    for request in sorted(kept, key=scheduler._rank):  # drafts in rank order too
        k = max(0, min(wanted[id(request)], request.remaining_budget - 1))
        while k > 0 and not scheduler.kv.can_grow(request.block_table, request.num_computed + 1 + k):
            k -= 1
        scheduler.kv.grow(request.block_table, request.num_computed + 1 + k)
        drafts[id(request)] = k
    return kept, [drafts[id(r)] for r in kept]


def state(scheduler: Scheduler) -> tuple:
    """What a reservation may change, block ids aside (the shortcut hands them out in another order)."""
    running = sorted((r.request_id, r.status.value, len(r.block_table), r.num_computed) for r in scheduler.running)
    waiting = [(r.request_id, r.status.value, len(r.block_table), r.num_computed) for r in scheduler.waiting]
    return running, waiting, scheduler.kv.num_free_blocks, scheduler.num_preemptions


requests_strategy = st.lists(
    st.tuples(st.integers(1, 9), st.integers(1, 8), st.integers(0, 6)),  # prompt tokens, max_tokens, wanted K
    min_size=1,
    max_size=6,
)


@settings(max_examples=300, deadline=None)
@given(requests_strategy, st.integers(1, 24), st.booleans())
def test_the_reservation_is_the_two_phase_reference(specs, num_blocks, priority):
    layout = KVLayout(num_planes=1, num_kv_heads=1, head_dim=2, num_loop_planes=1)
    kv = KVCache(layout, num_blocks, block_size=BLOCK, dtype=torch.float32, device="cpu")
    scheduler = Scheduler(kv, max_batch_size=8, max_num_batched_tokens=64, policy="priority" if priority else "fcfs")
    requests, wanted_k = [], []
    for i, (prompt, max_tokens, k) in enumerate(specs):
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        request = Request(f"r{i}", i, list(range(1, prompt + 1)), params, seed=0, eos_token_ids=[0], max_model_len=64)
        request.priority = (i * 7) % 3 if priority else 0
        need = prompt - 1  # every prompt token but the last has KV
        if not kv.can_grow(request.block_table, need):
            break  # the cache holds the requests admitted so far
        kv.grow(request.block_table, need)
        request.num_computed = need
        request.status = RequestStatus.RUNNING
        scheduler.running.append(request)
        requests.append(request)
        wanted_k.append(k)
    if not requests:
        return
    twin = copy.deepcopy((scheduler, requests))
    kept, drafts = scheduler.reserve_decode(requests, wanted_k)
    ref_kept, ref_drafts = reference_reserve(twin[0], twin[1], wanted_k)
    assert [r.request_id for r in kept] == [r.request_id for r in ref_kept]
    assert drafts == ref_drafts
    assert state(scheduler) == state(twin[0])
    held = sorted(b for r in scheduler.running for b in r.block_table)
    assert len(held) == len(set(held)) and len(held) + kv.num_free_blocks == num_blocks  # no block lost or shared


def test_when_blocks_run_short_the_request_that_goes_first_keeps_its_drafts():
    """Under priority scheduling the drafts go by rank as the tokens do: a request of higher priority later in the
    batch keeps its drafts where one of lower priority before it would have taken the last free block."""
    layout = KVLayout(num_planes=1, num_kv_heads=1, head_dim=2, num_loop_planes=1)
    kv = KVCache(layout, 3, block_size=BLOCK, dtype=torch.float32, device="cpu")
    scheduler = Scheduler(kv, max_batch_size=8, max_num_batched_tokens=64, policy="priority")
    requests = []
    for i, priority in enumerate((1, 0)):  # r0 first in the batch, r1 of the higher priority (lower value)
        request = Request(f"r{i}", i, [1, 2], SamplingParams(max_tokens=8), seed=0, eos_token_ids=[0], max_model_len=64)
        request.priority = priority
        kv.grow(request.block_table, 1)
        request.num_computed, request.status = 1, RequestStatus.RUNNING
        scheduler.running.append(request)
        requests.append(request)
    kept, drafts = scheduler.reserve_decode(requests, [2, 2])  # one free block: drafts for one request only
    assert [r.request_id for r in kept] == ["r0", "r1"] and drafts == [0, 2]
