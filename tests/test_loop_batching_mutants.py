"""Loop-level batching outcomes a mutation audit found unchecked: each test here failed against a small change to
looped_spec/loop_batching/ that every other test let through."""

from __future__ import annotations

from conftest import make_engine

from looped_spec import SamplingParams


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
