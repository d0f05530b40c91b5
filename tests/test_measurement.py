"""Counterfactual readouts as often as their time budget allows (control/measurement.py)."""

from __future__ import annotations

import pytest
from conftest import fixture_dir

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.control.measurement import MeasureSchedule


def due_pattern(schedule: MeasureSchedule, speculative: bool, rounds: int) -> list[bool]:
    return [schedule.due(speculative) for _ in range(rounds)]


def test_interval_follows_the_measured_rounds_extra_cost():
    """A measured round is compared with the median of unmeasured rounds of its own shape (batch size, K, d);
    the interval is the extra cost fraction over the 1 % budget."""
    s = MeasureSchedule(budget=0.01, min_every=2, max_every=64, initial_every=8)
    assert s.due(False) and s.due(True)  # the first round of each kind is measured
    assert s.every(False) == s.every(True) == 8  # until a cost is known
    for t in (1.0, 1.02, 0.98, 1.0, 5.0):  # unmeasured plain rounds at B=4 (one stalled)
        s.observe((4, 0, 0), False, t)
    s.observe((4, 0, 0), True, 1.03)  # 3 % dearer than the median unmeasured round -> every 3rd plain round
    assert s.every(False) == 3
    assert due_pattern(s, False, 6) == [False, False, True, False, False, True]
    for t in (2.0, 2.0, 2.0, 2.0):
        s.observe((4, 3, 1), False, t)
    s.observe((8, 3, 1), True, 4.8, 0.8)  # another batch size: never compared; only its readouts' own time counts
    assert s.every(True) == 20  # 0.8 s of readouts in a 4.8 s round: 20 % of the rest
    s.observe((4, 3, 1), True, 2.4)  # 20 % dearer than its own shape
    assert s.every(True) == 20 and sum(due_pattern(s, True, 200)) == 10
    for _ in range(8):  # the median of the last WINDOW estimates: old ones age out; clamped to max_every
        s.observe((4, 3, 1), True, 5.0)
    assert s.every(True) == 64
    for _ in range(8):  # a measured round no dearer than the unmeasured ones: still not every round
        s.observe((4, 0, 0), True, 0.9)
    assert s.every(False) == 2


def test_fixed_interval_and_bad_settings():
    s = MeasureSchedule(every=1)
    s.observe((1, 0, 0), True, 1.0, 0.5)
    assert all(due_pattern(s, False, 5)) and s.every(True) == 1
    bad_settings = ({"budget": 0.0}, {"min_every": 0}, {"min_every": 9, "max_every": 4}, {"initial_every": 99})
    for bad in (*bad_settings, {"every": 0}):
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
    every = engine.controller.stats()["measure_every"]
    assert every == {"plain": schedule.every(False), "speculative": schedule.every(True)}
