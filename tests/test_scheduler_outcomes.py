"""What the scheduler's KV decisions show a user: the order requests are admitted in after a preemption, when a
request is admitted at all, what a prefill step computes, and the KV a request holds between steps. Every output
equals an engine's with room to spare."""

from __future__ import annotations

import pytest
import torch
from conftest import make_engine

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.engine.scheduler import Scheduler
from looped_spec.execution.kv_cache import KVCache
from looped_spec.models.kv_layout import KVLayout
from looped_spec.request import Request, RequestStatus

SHARED = [5, 17, 29, 3, 88, 41, 9, 60, 2, 33, 71, 14, 90, 6, 25, 48, 7, 19, 64, 11]


def greedy(n: int) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def run_steps(engine: LoopedSpecEngine) -> dict:
    """Step `engine` until nothing is left; the finished outputs by request id, in the order they finished."""
    finished = {}
    while engine.has_unfinished_requests():
        finished.update((out.request_id, out) for out in engine.step() if out.finished)
    return finished


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_preempted_request_is_admitted_again_before_later_arrivals(policy):
    """A request preempted for lack of KV goes back ahead of a request that arrived after it (under "priority" too,
    at equal priority): once blocks come back it is the one admitted, and the later one waits for it."""
    engine = make_engine("ouro", block_size=4, num_kv_blocks=8, max_model_len=32, max_batch_size=2,
                         scheduling_policy=policy)  # fmt: skip
    prompts = {"A": list(range(3, 10)), "B": list(range(13, 20)), "C": list(range(23, 43))}
    lengths = {"A": 20, "B": 20, "C": 3}
    for name, prompt in prompts.items():  # B outgrows the cache beside A; C waits for room in the batch
        engine.add_request(prompt, greedy(lengths[name]), name)
    finished = run_steps(engine)
    assert list(finished) == ["A", "B", "C"]  # C, 6 blocks, fits beside neither A nor B
    assert finished["B"].metrics.num_preemptions == 1 and engine.num_free_blocks == engine.kv.num_blocks
    expected = make_engine("ouro").generate(list(prompts.values()), [greedy(n) for n in lengths.values()])
    assert [finished[name].token_ids for name in prompts] == [o.token_ids for o in expected]


@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_a_request_is_admitted_only_when_its_prompt_and_first_decoded_position_fit(policy):
    """Admission waits until the KV of the whole prompt and of the first decoded position is free, so admitting a
    request never forces a preemption: neither of the request admitted (recomputed at once) nor, under "priority",
    of a running request it outranks."""
    engine = make_engine("ouro", block_size=4, num_kv_blocks=8, max_model_len=32, scheduling_policy=policy)
    engine.add_request(list(range(3, 10)), greedy(20), "A")
    while engine.num_free_blocks > 3:  # A's KV grows to 5 of the 8 blocks
        engine.step()
    # 12 prompt tokens fill 3 blocks; the first decoded position needs a 4th
    engine.add_request(list(range(13, 25)), greedy(4), "B", priority=0 if policy == "fcfs" else -1)
    finished = run_steps(engine)
    assert engine.stats.num_preemptions == 0
    assert [finished[name].metrics.num_preemptions for name in "AB"] == [0, 0]


def test_a_request_whose_start_a_running_request_holds_is_admitted_beside_it():
    """With prefix caching, blocks a running request holds cost a request that shares them nothing: it is admitted
    when the free blocks hold the rest of its prompt, though not the whole of it, and runs beside the holder (which
    is not preempted)."""
    engine = make_engine("ouro", block_size=4, num_kv_blocks=8, max_model_len=32, prefix_caching=True)
    prompts = {"holder": SHARED[:17], "sharer": SHARED[:17] + [120, 121, 122]}
    lengths = {"holder": 10, "sharer": 2}
    engine.add_request(prompts["holder"], greedy(lengths["holder"]), "holder")
    engine.step()  # its prompt: 5 blocks, the first 4 full and cached; 3 free
    engine.add_request(prompts["sharer"], greedy(lengths["sharer"]), "sharer")  # 6 blocks, 4 of them the holder's
    finished = run_steps(engine)
    assert list(finished) == ["sharer", "holder"]
    assert finished["sharer"].metrics.num_cached_tokens == 16 and engine.stats.num_preemptions == 0
    assert engine.num_free_blocks == engine.kv.num_blocks
    expected = make_engine("ouro").generate(list(prompts.values()), [greedy(n) for n in lengths.values()])
    assert [finished[name].token_ids for name in prompts] == [o.token_ids for o in expected]


def test_prompt_chunks_of_a_prefill_step_stay_within_max_num_batched_tokens():
    """A prefill step computes at most max_num_batched_tokens prompt tokens, over every request it admits: a prompt
    of 40 tokens under a budget of 16 takes 3 steps, two of 10 take 2 (10 + 6, then 4)."""
    prompts = [list(range(3, 43)), list(range(50, 60)), list(range(60, 70))]
    expected = [o.token_ids for o in make_engine("ouro").generate(prompts, greedy(3))]
    for batch, steps in (([0], 3), ([1, 2], 2)):
        engine = make_engine("ouro", max_num_batched_tokens=16)
        outs = engine.generate([prompts[i] for i in batch], greedy(3))
        assert [o.token_ids for o in outs] == [expected[i] for i in batch]
        assert engine.stats.num_prefill_steps == steps
        assert engine.stats.num_prompt_tokens == sum(len(prompts[i]) for i in batch)


def test_kv_blocks_of_rejected_drafts_are_given_back_after_each_round():
    """After every step a request holds no more KV than its committed tokens need: the blocks its rejected drafts
    took come back at once, not when it finishes (blocks of one token, so each draft position is a block)."""
    engine = make_engine("ouro", speculation="3,1", block_size=1)
    prompts = {"0": list(range(3, 12)), "1": list(range(20, 25))}
    for name, prompt in prompts.items():
        engine.add_request(prompt, greedy(12), name)
    tokens = {name: len(prompt) for name, prompt in prompts.items()}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = len(out.prompt_token_ids) + len(out.token_ids)
            if out.finished:
                del tokens[out.request_id]
        assert engine.kv.num_blocks - engine.num_free_blocks <= sum(tokens.values())
    assert engine.stats.num_draft_tokens > engine.stats.num_accepted_tokens  # drafts were rejected
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_loop_passes_hold_at_most_max_num_batched_tokens_positions_of_prompt_chunks_in_flight():
    """Loop batching: chunks in flight count against max_num_batched_tokens, so two prompts of 16 tokens under a
    budget of 16 run one after the other, in waves of D passes as prefill steps would: the second's chunk starts
    once the first's left, and its first token comes 2·D passes in, not D + 1."""
    engine = make_engine("ouro", batching="loop", max_num_batched_tokens=16)
    prompts = {"A": list(range(3, 19)), "B": list(range(23, 39))}
    for name, prompt in prompts.items():
        engine.add_request(prompt, greedy(4), name)
    first_token_pass = {}
    outs = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            first_token_pass.setdefault(out.request_id, engine.stats.num_loop_passes)
            outs[out.request_id] = out
    depth = engine.adapter.full_depth
    assert first_token_pass == {"A": depth, "B": 2 * depth}
    expected = make_engine("ouro").generate(list(prompts.values()), greedy(4))
    assert [outs[name].token_ids for name in prompts] == [o.token_ids for o in expected]


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_no_decode_round_serves_more_than_max_batch_size_requests(batching):
    """Five requests under max_batch_size=2: the others wait in the queue, every round serves at most 2."""
    engine = make_engine("ouro", max_batch_size=2, batching=batching)
    prompts = [list(range(3 + i, 9 + i)) for i in range(5)]
    outs = engine.generate(prompts, greedy(4))
    assert max(engine.stats.batch_size_histogram) == 2
    assert [o.token_ids for o in outs] == [o.token_ids for o in make_engine("ouro").generate(prompts, greedy(4))]


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_a_request_aborted_while_it_waits_never_runs(batching):
    """Aborted in the queue (the batch is full), a request is reported once, with no tokens, and never admitted:
    no prompt token of it is computed and the others finish as alone."""
    engine = make_engine("ouro", max_batch_size=1, batching=batching)
    prompts = {"runs": list(range(3, 9)), "aborted": list(range(20, 30))}
    for name, prompt in prompts.items():
        engine.add_request(prompt, greedy(4), name)
    reported = [(out.request_id, out.finish_reason) for out in engine.step() if out.finished]
    engine.abort("aborted")
    outs = []
    while engine.has_unfinished_requests():
        outs += [out for out in engine.step() if out.finished]
    reported += [(out.request_id, out.finish_reason) for out in outs]
    assert sorted(reported) == [("aborted", "abort"), ("runs", "length")]
    assert [out.token_ids for out in outs if out.request_id == "aborted"] == [[]]
    assert engine.stats.num_prompt_tokens == len(prompts["runs"])
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_a_prompt_computed_in_chunks_is_found_cached_before_it_completes():
    """With prefix caching, each chunk's full blocks are registered once the step that computed them commits: a
    request admitted while a long prompt is still being prefilled finds the blocks computed so far."""
    long_prompt = list(range(100, 140))  # 40 tokens: chunks of 16, 16 and 8 under the budget of 16
    other = long_prompt[:36] + [7, 8, 9, 10]  # admitted beside the last chunk, after 32 tokens (8 blocks) were
    engine = make_engine("ouro", block_size=4, max_num_batched_tokens=16, prefix_caching=True)
    outs = engine.generate([long_prompt, other], greedy(3))
    assert [o.metrics.num_cached_tokens for o in outs] == [0, 32]
    expected = make_engine("ouro").generate([long_prompt, other], greedy(3))
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]


def test_the_tokens_of_a_prompt_chunk_whose_request_a_later_chunk_preempted_go_back_to_the_budget():
    """Under "priority" the running requests are in admission order: the prompt chunk of a request admitted later but
    ranked first may need the blocks of one scheduled before it in the same pass, and preempt it. That chunk does not
    run, and its tokens go back to the pass's budget of max_num_batched_tokens for the requests admitted after, as in
    vLLM's scheduler. (Two prompts are mid-prefill at once on loop passes, which start chunks while others are in
    flight.) Blocks of one token, so a request's blocks are its tokens."""
    kv = KVCache(KVLayout(1, 1, 2, 1), num_blocks=12, block_size=1, dtype=torch.float32, device="cpu")
    scheduler = Scheduler(kv, max_batch_size=4, max_num_batched_tokens=10, policy="priority")

    def request(name: str, arrival: int, prompt_len: int, priority: int) -> Request:
        new = Request(name, arrival, list(range(1, prompt_len + 1)), SamplingParams(), seed=0, eos_token_ids=[0],
                      max_model_len=64)  # fmt: skip
        new.priority = priority
        return new

    late, early, third = request("late", 0, 5, 1), request("early", 1, 8, 0), request("third", 2, 3, 0)

    def started(batch) -> list[tuple[str, int]]:
        """The prompt chunks a pass starts."""
        return [(r.request_id, n) for r, n in zip(batch.requests, batch.chunk_lens) if n]

    for admitted, in_flight in ((late, {"other": 8}), (early, {"late": 8})):  # each starts a chunk of 2
        scheduler.add(admitted)
        assert started(scheduler.schedule_pass(in_flight)) == [(admitted.request_id, 2)]
        scheduler.postprocess([admitted], [[]], chunk_lens=[2])
    scheduler.add(third)
    # late's last 3 prompt tokens, then early's 6: 9 of the 10 tokens, but 9 blocks of the 8 free: early preempts late
    batch = scheduler.schedule_pass({})
    assert late.status is RequestStatus.WAITING
    # late's 3 tokens came back: the third prompt starts whole (not 1 token of it)
    assert started(batch) == [("early", 6), ("third", 3)]
