"""Counterfactual readouts as often as their time budget allows (control/measurement.py)."""

from __future__ import annotations

import pytest
from conftest import fixture_dir

from looped_spec import LoopedSpecEngine, SamplingParams
from looped_spec.control.measurement import MeasureSchedule


def due_pattern(schedule: MeasureSchedule, speculative: bool, rounds: int) -> list[bool]:
    return [schedule.due(speculative) for _ in range(rounds)]


def gaps(pattern: list[bool]) -> list[int]:
    at = [i for i, due in enumerate(pattern) if due]
    return [b - a for a, b in zip(at, at[1:])]


def test_interval_follows_the_measured_rounds_extra_cost():
    """A measured round is compared with the median of unmeasured rounds of its own shape (batch size, K, d);
    the interval is the extra cost fraction over the 1 % budget; gaps are jittered around it."""
    s = MeasureSchedule(budget=0.01, min_every=2, max_every=64, initial_every=8)
    assert s.due(False) and s.due(True)  # the first round of each kind is measured
    assert s.every(False) == s.every(True) == 8  # until a cost is known
    for t in (1.0, 1.02, 0.98, 1.0, 5.0):  # unmeasured plain rounds at B=4 (one stalled)
        s.observe((4, 0, 0), False, t)
    s.observe((4, 0, 0), True, 1.03)  # 3 % dearer than the median unmeasured round -> every 3rd plain round
    assert s.every(False) == 3
    plain = gaps(due_pattern(s, False, 3000))
    assert set(plain) == {2, 3, 4}  # every·[0.5, 1.5), rounded
    assert 2.85 < sum(plain) / len(plain) < 3.15
    for t in (2.0, 2.0, 2.0, 2.0):
        s.observe((4, 3, 1), False, t)
    s.observe((8, 3, 1), True, 4.8, 0.8)  # another batch size: never compared; only its readouts' own time counts
    assert s.every(True) == 20  # 0.8 s of readouts in a 4.8 s round: 20 % of the rest
    s.observe((4, 3, 1), True, 2.4)  # 20 % dearer than its own shape
    assert s.every(True) == 20
    spec = gaps(due_pattern(s, True, 20000))
    assert min(spec) >= 10 and max(spec) <= 30 and 19.0 < sum(spec) / len(spec) < 21.0
    for _ in range(8):  # the median of the last WINDOW estimates: old ones age out; clamped to max_every
        s.observe((4, 3, 1), True, 5.0)
    assert s.every(True) == 64
    for _ in range(8):  # a measured round no dearer than the unmeasured ones: still not every round
        s.observe((4, 0, 0), True, 0.9)
    assert s.every(False) == 2


def test_jittered_gaps_read_a_repeated_generation_at_many_positions():
    """A fixed gap reads a prompt decoded again at the same positions every time; jittered gaps (seeded, so
    reproducible) spread over the generation."""
    length, repeats = 64, 8

    def positions(schedule: MeasureSchedule) -> set[int]:
        pattern = due_pattern(schedule, False, length * repeats)
        return {i % length for i, due in enumerate(pattern) if due}

    fixed = MeasureSchedule(every=4)
    assert positions(fixed) == set(range(0, length, 4))  # 16 positions, the same ones each time
    jittered = MeasureSchedule(min_every=4, initial_every=4)
    assert len(positions(jittered)) > 40
    runs = [MeasureSchedule(min_every=4, initial_every=4, seed=seed) for seed in (0, 0, 1)]
    first, second, third = (due_pattern(x, False, 200) for x in runs)
    assert first == second != third


def test_young_estimates_measure_at_the_young_budget():
    """While the policy's acceptance is young the interval is the extra cost over 5 % instead of 1 % (floor 1)
    where a measured round costs at most 10 % extra; before any cost is known a young schedule measures every
    round; dear readouts keep the normal interval."""
    s = MeasureSchedule(budget=0.01, min_every=4, initial_every=8)
    assert all(due_pattern_young(s, 20))
    assert s.every(False, young=True) == 1 and s.every(False) == 8
    for t in (1.0, 1.0, 1.0, 1.0):
        s.observe((1, 0, 0), False, t)
    s.observe((1, 0, 0), True, 1.04)  # 4 %: every 4th round normally, every round while young
    assert s.every(False) == 4 and s.every(False, young=True) == 1
    assert all(due_pattern_young(s, 50)) and sum(due_pattern(s, False, 400)) < 150
    for _ in range(8):
        s.observe((1, 0, 0), True, 1.08)  # 8 %: every 8th round, every 2nd while young
    assert s.every(False) == 8 and s.every(False, young=True) == 2
    young = gaps(due_pattern_young(s, 3000))
    assert set(young) == {1, 2, 3} and 1.9 < sum(young) / len(young) < 2.1
    for _ in range(8):
        s.observe((1, 0, 0), True, 1.3)  # 30 %: every 30th round, young or not
    assert s.every(False) == 30 and s.every(False, young=True) == 30
    with pytest.raises(ValueError):
        MeasureSchedule(budget=0.02, young_budget=0.01)


def test_plain_rounds_far_from_a_switch_measure_at_the_far_budget():
    """`far`: the interval is the extra cost over the 0.25 % budget (at least the normal interval, at most
    max_every); a young estimate still measures at the young budget; the first estimate before any cost is the
    initial interval either way."""
    s = MeasureSchedule(budget=0.01, min_every=4, initial_every=8, max_every=64)
    assert s.every(False, far=True) == s.every(False) == 8
    for t in (1.0, 1.0, 1.0, 1.0):
        s.observe((1, 0, 0), False, t)
    s.observe((1, 0, 0), True, 1.04)  # 4 %: every 4th round, every 16th far from a switch
    assert s.every(False) == 4 and s.every(False, far=True) == 16
    assert s.every(False, young=True, far=True) == 1  # young wins: its estimate needs the readouts
    far = gaps([s.due(False, far=True) for _ in range(8000)])
    assert 15.0 < sum(far) / len(far) < 17.0 and min(far) >= 8 and max(far) <= 24
    assert s.quiet_rounds(False, far=True) <= 23
    for _ in range(8):
        s.observe((1, 0, 0), True, 1.3)  # 30 %: every 30th round; far 120, clamped to max_every
    assert s.every(False) == 30 and s.every(False, far=True) == 64
    for bad in (0.0, 0.02):
        with pytest.raises(ValueError):
            MeasureSchedule(budget=0.01, far_budget=bad)


def due_pattern_young(schedule: MeasureSchedule, rounds: int) -> list[bool]:
    return [schedule.due(False, young=True) for _ in range(rounds)]


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
    assert every == {
        "plain": schedule.every(False),
        "plain_far": schedule.every(False, far=True),
        "speculative": schedule.every(True),
    }
