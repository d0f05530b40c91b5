"""Property test of the adaptive controller: any sequence of rounds the engine may produce — batch sizes jumping
about, requests coming and going (ids reused), feedback arriving late and out of order (loop passes), rounds
abandoned, measured rounds with any readout bits, early exits, rounds with no time of their own — keeps every
plan one the controller may hand out and every estimate finite and in range, for both policies and every shipped
tiny preset."""

from __future__ import annotations

import json
import math
import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from workload import Workload

from looped_spec.control import AdaptiveController
from looped_spec.control.passcost import PassCost
from looped_spec.control.plan import round_feedback
from looped_spec.presets import read_preset_file
from looped_spec.presets.lookup import shipped_preset_path

PRESETS = {name: read_preset_file(shipped_preset_path(name)) for name in ("tiny-ouro", "tiny-nanbeige", "tiny-huginn")}

rounds = st.lists(
    st.tuples(
        st.integers(1, 40),  # batch size
        st.floats(0.0, 3000.0),  # mean context
        st.integers(0, 3),  # how many of the rounds in flight report (oldest first) before the next plan ...
        st.booleans(),  # ... or whether one of them is abandoned instead
        st.floats(0.0, 1.0),  # the text's agreement
        st.sampled_from(["timed", "untimed", "exits-skip", "exits-select"]),
        st.integers(0, 3),  # how many request ids are new this round
    ),
    min_size=1,
    max_size=80,
)


def feedback(plan, ids: list[str], alpha: float, kind: str, rng: random.Random, depth: int, cost: PassCost):
    """What a round of `plan` on requests `ids` may report: drafts cut short near a request's end, readouts when
    measured, early exits, a wall time (none on loop passes)."""
    proposed = [min(plan.k, rng.randrange(plan.k + 1)) if rng.random() < 0.2 else plan.k for _ in ids]
    accepted = []
    for k in proposed:
        a = 0
        while a < k and rng.random() < alpha:
            a += 1
        accepted.append(a)
    fields = {}
    if plan.measure_depths:
        alphas = [min(1.0, alpha + j / depth) for j in range(depth - 1)] + [1.0]
        fields = Workload(cost, seed=rng.randrange(1 << 30))._readouts(alphas, plan.k, plan.d, accepted, None, ids)
    fields.setdefault("request_ids", ids)
    if kind.startswith("exits"):
        fields["exit_depths"] = [rng.randint(1, depth) for a in accepted for _ in range(a + 1)]
        fields["exit_skips"] = kind == "exits-skip"
    seconds = 0.0 if kind == "untimed" else cost.seconds(plan.k, plan.d, len(ids), 100.0) * rng.uniform(0.3, 3.0)
    return round_feedback(
        plan, batch_size=len(ids), context=100.0, num_proposed=proposed, num_accepted=accepted, seconds=seconds,
        **fields,
    )  # fmt: skip


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    name=st.sampled_from(sorted(PRESETS)), policy=st.sampled_from(["goodput", "ema"]), steps=rounds, seed=st.integers()
)
def test_any_sequence_of_rounds_keeps_plans_valid_and_estimates_finite(name, policy, steps, seed):
    config = PRESETS[name]
    depth = config.full_depth
    controller = AdaptiveController(config, depth, policy)
    shapes = set(controller.plan_shapes())
    rng = random.Random(seed)
    in_flight, live, next_id, last_id = [], [], 0, -1
    for batch, context, reports, abandon, alpha, kind, fresh in steps:
        # the batch: some requests stay, some leave, new ones join (the engine's ids are never reused; a caller's
        # may be, which the estimator must take too)
        live = live[fresh:] if fresh else live
        while len(live) < batch:
            live.append(f"r{next_id % 97}")
            next_id += 1
        ids = list(dict.fromkeys(live[:batch]))
        plan = controller.plan(len(ids), context, ids)
        assert plan.plan_id == last_id + 1
        last_id = plan.plan_id
        assert (plan.k, plan.d if plan.k else 0) in shapes
        assert plan.k == 0 or 1 <= plan.d < depth
        in_flight.append((plan, ids, alpha, kind))
        if abandon and in_flight:
            controller.abandon(in_flight.pop(rng.randrange(len(in_flight)))[0])
        for _ in range(min(reports, len(in_flight))):
            plan, ids, alpha, kind = in_flight.pop(0)
            controller.observe(feedback(plan, ids, alpha, kind, rng, depth, controller.cost))
        est, cost = controller.acceptance, controller.cost
        assert all(0.0 <= a <= 1.0 for a in est.alpha + est.batch_alpha()), est.alpha
        assert all(0.0 <= r <= 1.0 for r in est.rho), est.rho
        assert math.isfinite(cost.drift) and cost.drift > 0.0
        assert math.isfinite(cost.speculative_factor()) and cost.speculative_factor() > 0.0
        assert math.isfinite(cost.measure_share(2, 1, batch, context))
    json.dumps(controller.stats(), allow_nan=False)  # every number a reader gets is finite
