"""Counterfactual readouts as often as their time budget allows (control/measurement.py)."""

from __future__ import annotations

import pytest
from conftest import fixture_dir

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.control.measurement import MeasureSchedule


def due_pattern(schedule: MeasureSchedule, speculative: bool, rounds: int) -> list[bool]:
    return [schedule.due(speculative) for _ in range(rounds)]


def test_interval_follows_the_readouts_cost_fraction():
    s = MeasureSchedule(budget=0.01, min_every=2, max_every=64)
    assert s.due(False) and s.due(True)  # the first round of each kind is measured, to learn the cost
    s.observe(False, 0.03, 1.03)  # readouts cost 3 % of the rest of a plain round -> every 3rd plain round
    s.observe(True, 0.2, 1.2)  # 20 % of a speculative round -> every 20th
    assert s.every(False) == 3 and s.every(True) == 20
    assert due_pattern(s, False, 6) == [False, False, True, False, False, True]
    assert sum(due_pattern(s, True, 200)) == 10
    s.observe(False, 0.0001, 1.0)  # nearly free: still not every round
    s.observe(False, 0.0001, 1.0)
    assert s.every(False) == 2
    for _ in range(8):  # the median of the last WINDOW measured rounds: old fractions age out
        s.observe(True, 5.0, 6.0)
    assert s.every(True) == 64


def test_fixed_interval_and_bad_settings():
    s = MeasureSchedule(every=1)
    s.observe(False, 0.5, 1.0)
    assert all(due_pattern(s, False, 5)) and s.every(True) == 1
    for bad in ({"budget": 0.0}, {"min_every": 0}, {"min_every": 9, "max_every": 4}, {"every": 0}):
        with pytest.raises(ValueError):
            MeasureSchedule(**bad)


def test_engine_times_the_readouts_and_sets_the_interval():
    """An adaptive (goodput) engine measures its first plain round, times the readouts inside it and then
    measures plain rounds at the interval their cost allows; greedy output stays plain decoding's."""
    prompts = [[5, 6, 7, 8], [9, 10, 11]]
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    engine = LoopedSpecEngine(model=str(fixture_dir("ouro")), speculation="adaptive", max_batch_size=4)
    plain = LoopedSpecEngine(model=str(fixture_dir("ouro")), speculation="off", max_batch_size=4)
    seen = []
    observe = engine.controller.observe
    engine.controller.observe = lambda fb: (seen.append(fb), observe(fb))[1]
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in plain.generate(prompts, params)]
    measured = [fb for fb in seen if fb.depth_trials]
    assert measured and all(0.0 < fb.measure_time < fb.round_time for fb in measured)
    assert all(fb.measure_time == 0.0 for fb in seen if not fb.depth_trials)
    schedule = engine.controller.measure
    kinds = {fb.k > 0 for fb in measured}
    assert all(2 <= schedule.every(kind) <= 64 for kind in kinds)
