"""Loop-level batching outcomes a mutation audit found unchecked: each test here failed against a small change to
looped_spec/loop_batching/ that every other test let through."""

from __future__ import annotations

from conftest import load, make_engine
from test_loop_batching import agreement_totals, recorded_feedback

from looped_spec import SamplingParams, SpeculativeConfig


def test_a_pass_budget_is_filled_when_the_work_fits_it_exactly():
    """max_pass_positions=2 with two one-token requests: every pass takes both (the budget is an upper bound the work
    may reach, not one it must stay below), so occupancy is exactly 2 positions per pass."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = make_engine("ouro", batching="loop", max_pass_positions=2)
    outputs = engine.generate([[100], [7]], params)
    assert all(len(out.token_ids) == 4 for out in outputs)
    stats = engine.stats
    assert stats.num_loop_passes > 0
    assert stats.num_loop_pass_positions == 2 * stats.num_loop_passes


def test_under_a_pass_budget_work_at_equal_depth_takes_turns():
    """A budget of one position and two requests whose tokens start at loop 0 together: the one that ran longest ago
    goes first, so their tokens alternate (neither streams its whole output while the other waits)."""
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine = make_engine("ouro", batching="loop", max_pass_positions=1)
    first, second = engine.add_request([100], params), engine.add_request([7], params)
    counts, order = {first: 0, second: 0}, []
    for _ in range(500):
        if not engine.has_unfinished_requests():
            break
        for out in engine.step():
            if out.new_token_ids:
                counts[out.request_id] += len(out.new_token_ids)
                order.append(out.request_id)
                assert abs(counts[first] - counts[second]) <= 1, order
    assert counts == {first: 4, second: 4}


def test_a_request_aborted_at_any_pass_of_a_speculative_round_leaves_nothing_behind():
    """Abort after every possible number of passes (a draft entering, a verification in flight, between rounds): the
    engine keeps no work of the aborted request, reports it once, and every KV block is free."""
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    for passes in range(1, 12):
        engine = make_engine("ouro", batching="loop", speculation=SpeculativeConfig(k=3, d=1))
        request_id = engine.add_request([5, 9, 2, 7], params)
        for _ in range(passes):
            engine.step()
        if not engine.has_unfinished_requests():
            break
        engine.abort(request_id)
        reports = [out for out in engine.step() if out.finished]
        assert [out.finish_reason for out in reports] == ["abort"], passes
        assert engine.loop_batcher.is_empty, passes
        assert engine.num_free_blocks == engine.kv.num_blocks, passes


def test_drafts_exiting_one_loop_short_of_full_depth_equal_the_step_engine():
    """Skip mode, drafts of depth D-1 under Ouro's gate at 0.9: tokens exit at every depth, drafts at D-1 among them,
    whose last loop plane gets their exit loop's KV for later positions that run to D to attend to: tokens and exit
    depths equal the step engine's, greedy and sampled."""
    depth = load("ouro").full_depth
    spec = SpeculativeConfig(k=2, d=depth - 1)
    params = [SamplingParams(max_tokens=10, temperature=0.8 * (i % 2), seed=i, ignore_eos=True, exit_threshold=0.9)
              for i in range(len(PROMPTS))]  # fmt: skip
    step = make_engine("ouro", speculation=spec, early_exit="skip")
    loop = make_engine("ouro", speculation=spec, early_exit="skip", batching="loop")
    assert run(loop, PROMPTS, params) == run(step, PROMPTS, params)
    assert loop.stats.exit_depth_histogram == step.stats.exit_depth_histogram
    assert loop.stats.exit_depth_histogram[depth - 1] > 0
    assert loop.num_free_blocks == loop.kv.num_blocks and loop.loop_batcher.is_empty


def test_per_token_stopping_on_loop_passes_equals_the_step_engine():
    """A plan with a stopping margin: a round stops drafting at its first unsure draft and is verified as it stands,
    on loop passes as in step rounds: tokens, drafts and accepted drafts equal the step engine's, greedy and
    sampled, and no KV block is left held."""
    spec = SpeculativeConfig(k=4, d=1, stop_margin=0.01)
    params = [SamplingParams(max_tokens=10, temperature=0.8 * (i % 2), seed=i, ignore_eos=True)
              for i in range(len(PROMPTS))]  # fmt: skip
    step = make_engine("ouro", speculation=spec)
    loop = make_engine("ouro", speculation=spec, batching="loop")
    assert run(loop, PROMPTS, params) == run(step, PROMPTS, params)
    assert 0 < loop.stats.num_draft_tokens == step.stats.num_draft_tokens
    assert loop.stats.num_accepted_tokens == step.stats.num_accepted_tokens
    assert loop.num_free_blocks == loop.kv.num_blocks and loop.loop_batcher.is_empty


def test_a_request_preempted_after_many_exits_recomputes_them_at_their_own_depths():
    """Skip mode under Ouro's gate at 0.7, a KV pool that preempts requests 16 tokens in: the recompute gives each
    generated token's deeper planes the KV of that token's own recorded exit (not its neighbour's), so tokens and
    exit depths equal a step engine's that never preempts, greedy and sampled."""
    params = [SamplingParams(max_tokens=16, temperature=0.8 * (i % 2), seed=i, ignore_eos=True, exit_threshold=0.7)
              for i in range(4)]  # fmt: skip
    reference = make_engine("ouro", early_exit="skip")
    expected = run(reference, PROMPTS[:4], params)
    engine = make_engine("ouro", batching="loop", early_exit="skip", block_size=4, num_kv_blocks=12,
                         max_model_len=24)  # fmt: skip
    assert run(engine, PROMPTS[:4], params) == expected
    assert engine.scheduler.num_preemptions > 0
    assert engine.stats.exit_depth_histogram == reference.stats.exit_depth_histogram
    assert engine.num_free_blocks == engine.kv.num_blocks


def test_skip_mode_drafts_decided_within_the_draft_leave_no_verification_to_run():
    """Skip mode, d=1 under exit_at_step=1: every draft exits within the draft (the target's own token), so a round
    runs no verification loop: speculation costs the same loop passes and positions as plain decoding under the
    same exit, with the same tokens."""
    prompts = PROMPTS[:3]
    params = SamplingParams(max_tokens=9, ignore_eos=True, exit_at_step=1)
    spec = make_engine("ouro", batching="loop", early_exit="skip", speculation=SpeculativeConfig(k=2, d=1))
    plain = make_engine("ouro", batching="loop", early_exit="skip")
    assert run(spec, prompts, params) == run(plain, prompts, params)
    assert spec.stats.num_exit_draft_decided > 0
    assert spec.stats.num_loop_pass_positions == plain.stats.num_loop_pass_positions
    assert spec.stats.num_loop_passes == plain.stats.num_loop_passes


def test_skip_mode_verification_stops_once_its_rows_exited():
    """Skip mode, d=1 under exit_at_step=2: a round's positions run loop 1 in the draft and loop 2 in the
    verification, where all exit; the verification then ends, short of D. Positions over all passes: the prompts' at
    full depth, then two loops of every round position (each round has its drafts plus one positions, and commits
    its accepted drafts plus one tokens)."""
    prompts, max_tokens = PROMPTS[:3], 9
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, exit_at_step=2)
    engine = make_engine("ouro", batching="loop", early_exit="skip", speculation=SpeculativeConfig(k=2, d=1))
    assert all(len(tokens) == max_tokens for tokens in run(engine, prompts, params))
    stats = engine.stats
    rounds = len(prompts) * (max_tokens - 1) - stats.num_accepted_tokens  # the first token is the prompt's
    round_positions = stats.num_draft_tokens + rounds
    depth = load("ouro").full_depth
    assert stats.num_loop_pass_positions == sum(map(len, prompts)) * depth + 2 * round_positions


def test_measured_rounds_under_a_penalty_count_what_the_step_engine_counts():
    """Measured rounds of requests with a repetition penalty: each depth's greedy choice at a round position is
    adjusted for the drafts before that position only (as a draft there would be), so the agreement per depth equals
    the step engine's."""
    spec = SpeculativeConfig(k=3, d=2, measure_depths=True)
    params = [SamplingParams(max_tokens=10, ignore_eos=True, repetition_penalty=2.0) for _ in PROMPTS]
    step = make_engine("ouro", speculation=spec)
    loop = make_engine("ouro", speculation=spec, batching="loop")
    step_feedback, loop_feedback = recorded_feedback(step), recorded_feedback(loop)
    assert run(loop, PROMPTS, params) == run(step, PROMPTS, params)
    depth = load("ouro").full_depth
    expected = agreement_totals(step_feedback, depth)
    assert sum(expected[0]) > 0
    assert agreement_totals(loop_feedback, depth) == expected


PROMPTS = [[5, 9, 2, 7], [1, 2, 3], [44, 8, 19, 20, 21, 3, 7], [100], [6, 6, 6, 6, 6], [17, 3, 90, 4]]


def run(engine, prompts, params) -> list[list[int]]:
    return [out.token_ids for out in engine.generate(prompts, params)]
