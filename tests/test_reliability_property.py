"""Issue 11, done-when: random mixes of requests, aborts, online adds during generate(), a cache small
enough to preempt, random fixed and adaptive speculation, prefix caching on or off (prompts often begin alike),
logit biases and penalties, first-come-first-served or priority scheduling with random priorities, and one-shot faults
injected into model code.

Checked after every step: no KV block leaked, no request reported finished twice; at the end every
request reported finished exactly once, each greedy output (and each sampled one when speculation is
off) equal to the same prompt run alone with speculation off, and the engine still usable.

A second property: under a fixed plan with KV to spare, sampled requests too equal each one run alone under that plan
through one-shot faults in the loops and the readouts (a step that fails after its drafts were drawn must leave every
random generator as it was).

Deterministic by default (derandomized, no example database); set LOOPED_SPEC_HYPOTHESIS_EXAMPLES to
explore more examples locally.
"""

from __future__ import annotations

import gc
import os
from collections import Counter
from functools import cache

import pytest
from conftest import TokenizerFailingOn, load, make_engine
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from looped_spec import SamplingParams, SpeculativeConfig
from looped_spec.detokenizer import IncrementalDetokenizer

EXAMPLES = int(os.environ.get("LOOPED_SPEC_HYPOTHESIS_EXAMPLES", "25"))
#: the property tests' settings: reproducible examples (derandomized, no example database), each a whole engine run
RANDOM_WORKLOADS = settings(
    max_examples=EXAMPLES,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


class InjectedFault(RuntimeError):
    pass


class FaultyModel:
    """One-shot faults in model code: wraps the adapter's functions `names` (the loops; the readouts too, which run
    after a step's drafts were drawn: a fault there is one the random generators must be restored for). Once armed,
    the `countdown`-th call from now of any of them raises, once. The adapter is shared between tests: `remove()`."""

    def __init__(self, adapter, names: tuple[str, ...] = ("loop",)) -> None:
        self.adapter, self.names = adapter, names
        self.countdown: int | None = None
        self.fired = 0
        for name in names:
            setattr(adapter, name, self._wrap(getattr(adapter, name)))

    def arm(self, countdown: int) -> None:
        self.countdown = countdown

    def _wrap(self, original):
        def call(*args, **kwargs):
            if self.countdown is not None:
                if self.countdown == 0:
                    self.countdown = None
                    self.fired += 1
                    raise InjectedFault("injected fault in model code")
                self.countdown -= 1
            return original(*args, **kwargs)

        return call

    def remove(self) -> None:
        for name in self.names:
            delattr(self.adapter, name)


#: prompts often begin alike (a block of 4 tokens or more), so prefix caching has blocks to share
SHARED_STARTS = ([3, 1, 4, 1, 5, 9, 2, 6], [3, 1, 4, 1, 7, 7], [2, 7, 1, 8, 2, 8, 1, 8, 2, 8])
prompts_st = st.one_of(
    st.lists(st.integers(1, 255), min_size=1, max_size=14),
    st.tuples(st.sampled_from(SHARED_STARTS), st.lists(st.integers(1, 255), max_size=5)).map(lambda p: p[0] + p[1]),
)
requests_st = st.fixed_dictionaries(
    {
        "prompt": prompts_st,
        "max_tokens": st.integers(1, 14),
        "sampled": st.booleans(),
        "seed": st.integers(0, 2**31 - 1),
        "stop": st.lists(st.integers(0, 255), max_size=2),
        "ignore_eos": st.booleans(),
        "logit_bias": st.one_of(
            st.just({}), st.dictionaries(st.integers(0, 255), st.sampled_from([-100.0, -2.5, 1.5, 100.0]), max_size=3)
        ),
        "penalties": st.sampled_from(
            [{}, {}, {"repetition_penalty": 1.4}, {"presence_penalty": 1.0, "frequency_penalty": 0.5}]
        ),
        "min_tokens": st.sampled_from([0, 0, 3, 14]),  # at most max_tokens
        # its tokenizer cannot decode the token its run alone generates at this index (it decodes them for stop
        # strings): its commit fails there
        "undecodable_at": st.one_of(st.none(), st.none(), st.integers(0, 13)),
        "priority": st.integers(-2, 2),  # taken under scheduling_policy "priority", 0 under "fcfs"
    }
)
actions_st = st.lists(
    st.one_of(
        st.tuples(st.just("step")),
        st.tuples(st.just("step")),
        st.tuples(st.just("add"), requests_st),
        st.tuples(st.just("abort"), st.integers(0, 50)),
        st.tuples(st.just("generate"), st.lists(requests_st, min_size=1, max_size=2)),
        st.tuples(st.just("fault"), st.integers(0, 12)),
        st.tuples(st.just("fault"), st.integers(0, 3)),
    ),
    min_size=3,
    max_size=20,
)
scenarios_st = st.fixed_dictionaries(
    {
        "family": st.sampled_from(["ouro", "nanbeige", "huginn"]),
        "speculation": st.one_of(st.just("off"), st.just("adaptive"), st.tuples(st.integers(0, 3), st.integers(1, 7))),
        "num_kv_blocks": st.integers(8, 16),  # block_size 4, max_model_len 32: one request needs up to 8
        "prefix_caching": st.booleans(),
        "max_batch_size": st.integers(1, 4),
        "scheduling_policy": st.sampled_from(["fcfs", "priority"]),
        "initial": st.lists(requests_st, min_size=2, max_size=5),
        "actions": actions_st,
    }
)


def params_of(spec: dict) -> SamplingParams:
    temperature = 0.9 if spec["sampled"] else 0.0
    return SamplingParams(
        max_tokens=spec["max_tokens"],
        temperature=temperature,
        seed=spec["seed"],
        stop_token_ids=spec["stop"],
        ignore_eos=spec["ignore_eos"],
        logit_bias=spec.get("logit_bias", {}),
        min_tokens=min(spec.get("min_tokens", 0), spec["max_tokens"]),
        **spec.get("penalties", {}),
    )


@cache
def reference_engine(family: str):
    # one per family: an engine holds its KV cache until the cyclic garbage collector frees it
    return make_engine(family, max_model_len=32, num_kv_blocks=16, max_batch_size=1)


@cache
def alone(family: str, prompt: tuple[int, ...], params_json: str) -> tuple[int, ...]:
    """The output of one prompt run alone (batch size 1), speculation off."""
    params = SamplingParams.model_validate_json(params_json)
    return tuple(reference_engine(family).generate(list(prompt), params)[0].token_ids)


def speculation_of(scenario: dict):
    spec = scenario["speculation"]
    if isinstance(spec, str):
        return spec
    k, d = spec
    depth = load(scenario["family"]).full_depth
    return SpeculativeConfig(k=k, d=1 + (d - 1) % (depth - 1)) if k else SpeculativeConfig(k=0, d=0)


def held_blocks(engine) -> int:
    """The distinct blocks live requests hold (prefix caching shares blocks), each counted as held by every table
    that holds it."""
    live = list(engine.scheduler.running) + list(engine.scheduler.waiting)
    for request in engine._requests.values():
        if request.finished:
            assert not request.block_table, f"finished request {request.request_id} still holds KV blocks"
    holders = Counter(block for r in live for block in r.block_table)
    for block, count in holders.items():
        assert engine.kv.holders(block) == count, f"block {block}: {engine.kv.holders(block)} holders counted"
    return len(holders)


def scenario_engine(family: str, scenario: dict, speculation, **options):
    """The engine a random scenario runs on: small blocks, a KV cache and batch of the scenario's size, prompt chunks
    of 12 tokens (also the async front's property test's)."""
    return make_engine(
        family,
        speculation=speculation,
        block_size=4,
        num_kv_blocks=scenario["num_kv_blocks"],
        max_model_len=32,
        max_batch_size=scenario["max_batch_size"],
        max_num_batched_tokens=12,
        prefix_caching=scenario["prefix_caching"],
        **options,
    )


@pytest.mark.slow
@RANDOM_WORKLOADS
@given(scenarios_st)
def test_random_workloads_never_wedge_leak_or_lose_an_output(scenario):
    family = scenario["family"]
    speculation = speculation_of(scenario)
    engine = scenario_engine(family, scenario, speculation, scheduling_policy=scenario["scheduling_policy"])
    ranked = scenario["scheduling_policy"] == "priority"
    adapter = engine.adapter
    faulty = FaultyModel(adapter)  # the adapter is shared between tests: removed again in `finally`
    specs: dict[str, dict] = {}
    finished: dict = {}
    aborted: set[str] = set()
    last_step_ok = True

    def record(outputs) -> None:
        for out in outputs:
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} reported finished twice"
                finished[out.request_id] = out

    def add(spec: dict) -> None:
        request_id = engine.add_request(spec["prompt"], params_of(spec), priority=spec["priority"] if ranked else 0)
        at, bad = spec["undecodable_at"], None
        if at is not None:
            armed, faulty.countdown = faulty.countdown, None  # the reference run shares the adapter
            generated = alone(family, tuple(spec["prompt"]), params_of(spec).model_dump_json())
            faulty.countdown = armed
            bad = generated[at] if at < len(generated) else None
        if bad is not None:  # its stop string never matches: the text is letters
            engine._requests[request_id].detokenizer = IncrementalDetokenizer(TokenizerFailingOn(bad), stop=["!"])
        specs[request_id] = spec | {"undecodable": bad}

    def check_kv() -> None:
        assert engine.num_free_blocks + held_blocks(engine) == engine.kv.num_blocks, "KV blocks leaked"

    def step() -> None:
        nonlocal last_step_ok
        if not engine.has_unfinished_requests():
            return
        try:
            record(engine.step())
            last_step_ok = True
        except InjectedFault:
            last_step_ok = False
        check_kv()

    try:
        for spec in scenario["initial"]:
            add(spec)
        for action in scenario["actions"]:
            kind = action[0]
            if kind == "step":
                step()
            elif kind == "add":
                add(action[1])
            elif kind == "abort":
                live = [i for i in specs if i not in finished]
                if live:
                    target = live[action[1] % len(live)]
                    engine.abort(target)
                    aborted.add(target)
            elif kind == "generate":
                batch = action[1]
                try:
                    priority = [s["priority"] if ranked else 0 for s in batch]
                    outs = engine.generate(
                        [s["prompt"] for s in batch], [params_of(s) for s in batch], priority=priority
                    )
                except InjectedFault:  # generate() forgets its requests and raises
                    last_step_ok = False
                else:
                    last_step_ok = True
                    assert [o.finished for o in outs] == [True] * len(batch)
                    for out, spec in zip(outs, batch):
                        assert out.request_id not in specs
                        specs[out.request_id] = spec | {"undecodable": None}  # generate() gives them no tokenizer
                    record(outs)
                check_kv()
            elif kind == "fault" and faulty.countdown is None and last_step_ok:
                # one-shot: a fault never strikes the step right after another one
                faulty.arm(action[1])
        for _ in range(500):  # an armed fault may still fire here, once
            if not engine.has_unfinished_requests():
                break
            step()
        assert not engine.has_unfinished_requests(), "the engine is wedged"
        faulty.countdown = None  # the references below share the adapter
        assert sorted(finished) == sorted(specs), "a request was never reported finished"
        assert engine.num_free_blocks == engine.kv.num_blocks
        for request_id, out in finished.items():
            spec = specs[request_id]
            bad = spec["undecodable"]
            stops = set(spec["stop"]) | (set() if spec["ignore_eos"] else set(engine.adapter.eos_token_ids))
            # a token its tokenizer cannot decode is never committed, but for a stop token that ends the request
            assert bad is None or bad not in out.token_ids[:-1], "a token its tokenizer cannot decode was committed"
            if bad is not None and out.token_ids[-1:] == [bad]:
                assert bad in stops and out.finish_reason == "stop", (bad, out.finish_reason)
            if out.finish_reason == "error":  # only a request's own commit failure may finish it with an error
                assert bad is not None and f"cannot decode token {bad}" in out.error, out.error
            if spec["sampled"] and speculation != "off":
                continue  # same distribution, not the same draws
            expected = alone(family, tuple(spec["prompt"]), params_of(spec).model_dump_json())
            if bad in expected and bad not in stops and out.finish_reason != "abort":  # it fails at the first one
                expected = expected[: expected.index(bad)]
                assert out.finish_reason == "error", f"request {request_id} ({out.finish_reason})"
            if request_id in aborted and out.finish_reason == "abort":
                assert tuple(out.token_ids) == expected[: len(out.token_ids)]
            else:
                assert tuple(out.token_ids) == expected, f"request {request_id} ({out.finish_reason})"
        # what the example exercised (pytest --hypothesis-show-statistics)
        event(f"faults fired: {min(faulty.fired, 2)}")
        event(f"preempted: {engine.scheduler.num_preemptions > 0}")
        event(f"speculative rounds: {engine.stats.num_spec_rounds > 0}")
        event(f"aborted: {bool(aborted)}")
        event(f"prefix cache hits: {engine.stats.num_prefix_cache_hits > 0}")
        event(f"commit failed: {any(out.finish_reason == 'error' for out in finished.values())}")
        # still usable
        probe = {"prompt": [7, 8, 9], "max_tokens": 4, "sampled": False, "seed": 0, "stop": [], "ignore_eos": True}
        out = engine.generate(probe["prompt"], params_of(probe))[0]
        assert tuple(out.token_ids) == alone(family, (7, 8, 9), params_of(probe).model_dump_json())
    finally:
        faulty.remove()
        gc.collect()  # engines hold their KV cache in reference cycles: free earlier examples' engines


sampled_requests_st = st.fixed_dictionaries(
    {
        "prompt": st.lists(st.integers(1, 255), min_size=1, max_size=10),
        "max_tokens": st.integers(1, 12),
        "sampled": st.booleans(),
        "seed": st.integers(0, 2**31 - 1),
        "stop": st.just([]),
        "ignore_eos": st.just(True),
        "penalties": st.sampled_from([{}, {}, {"repetition_penalty": 1.4}]),
    }
)


class PlanIds:
    """The ids of the plans a controller gave, and of those it heard reported or abandoned (its methods wrapped)."""

    def __init__(self, controller) -> None:
        self.planned: list[int] = []
        self.reported: list[int] = []
        self.abandoned: list[int] = []
        plan, observe, abandon = controller.plan, controller.observe, controller.abandon

        def planned(*args, **kwargs):
            given = plan(*args, **kwargs)
            self.planned.append(given.plan_id)
            return given

        def observed(feedback) -> None:
            self.reported.append(feedback.plan_id)
            observe(feedback)

        def abandoned(given) -> None:
            self.abandoned.append(given.plan_id)
            abandon(given)

        controller.plan, controller.observe, controller.abandon = planned, observed, abandoned


def LONE_TOKEN(max_tokens: int) -> dict:  # noqa: N802 (reads as a constant in the examples)
    """A greedy request of prompt [1] (the examples' requests)."""
    return {"prompt": [1], "max_tokens": max_tokens, "sampled": False, "seed": 0, "stop": [], "ignore_eos": True,
            "penalties": {}}  # fmt: skip


@cache
def alone_under(family: str, k: int, d: int, prompt: tuple[int, ...], params_json: str) -> tuple[int, ...]:
    """The output of one prompt run alone (batch size 1) by the step engine under the fixed plan (k, d)."""
    engine = speculative_reference(family, k, d)
    return tuple(engine.generate(list(prompt), SamplingParams.model_validate_json(params_json))[0].token_ids)


@cache
def speculative_reference(family: str, k: int, d: int):
    return make_engine(family, speculation=SpeculativeConfig(k=k, d=d), max_model_len=32, max_batch_size=1)


@pytest.mark.slow
@RANDOM_WORKLOADS
@given(
    family=st.sampled_from(["ouro", "nanbeige", "huginn"]),
    batching=st.sampled_from(["step", "loop"]),
    plan=st.tuples(st.integers(1, 3), st.integers(1, 7)),
    initial=st.lists(sampled_requests_st, min_size=2, max_size=4),
    actions=st.lists(
        st.one_of(
            st.tuples(st.just("step")),
            st.tuples(st.just("add"), sampled_requests_st),
            st.tuples(st.just("fault"), st.integers(0, 12)),
        ),
        min_size=3,
        max_size=16,
    ),
)
# on loop passes the plan serving both requests' rounds reported twice: once the first request's one-token round
# finished, again for the later rounds under it
@example(family="ouro", batching="loop", plan=(3, 2), initial=[LONE_TOKEN(1), LONE_TOKEN(6)],
         actions=[("step",), ("step",), ("add", LONE_TOKEN(4))])  # fmt: skip
def test_sampled_speculative_requests_with_faults_draw_what_each_draws_alone(family, batching, plan, initial, actions):
    """Under a fixed plan with KV to spare (no draft is cut), a request's draws do not depend on its batch: each one,
    sampled or greedy, equals it run alone under that plan, whatever one-shot faults in the loops or the readouts (after
    the drafts were drawn) failed steps meanwhile. A failed step that left a generator advanced, or a fault pinned on a
    request, shows."""
    k, d = plan[0], 1 + (plan[1] - 1) % (load(family).full_depth - 1)
    engine = make_engine(family, speculation=SpeculativeConfig(k=k, d=d), batching=batching, block_size=4,
                         num_kv_blocks=64, max_model_len=32, max_batch_size=4,
                         max_num_batched_tokens=12)  # fmt: skip
    faulty = FaultyModel(engine.adapter, ("loop", "readout"))  # removed again in `finally`
    plan_ids = PlanIds(engine.controller)
    specs: dict[str, dict] = {}
    finished: dict = {}
    last_step_ok = True

    def step() -> None:
        nonlocal last_step_ok
        if not engine.has_unfinished_requests():
            return
        try:
            outputs = engine.step()
        except InjectedFault:
            last_step_ok = False
            return
        last_step_ok = True
        for out in outputs:
            if out.finished:
                assert out.request_id not in finished, f"{out.request_id} reported finished twice"
                finished[out.request_id] = out

    try:
        for spec in initial:
            specs[engine.add_request(spec["prompt"], params_of(spec))] = spec
        for action in actions:
            if action[0] == "step":
                step()
            elif action[0] == "add":
                specs[engine.add_request(action[1]["prompt"], params_of(action[1]))] = action[1]
            elif faulty.countdown is None and last_step_ok:  # one-shot: never the step right after another one
                faulty.countdown = action[1]
        for _ in range(400):
            if not engine.has_unfinished_requests():
                break
            step()
        faulty.countdown = None  # the references below share the adapter
        assert not engine.has_unfinished_requests(), "the engine is wedged"
        assert sorted(finished) == sorted(specs), "a request was never reported finished"
        assert engine.num_free_blocks == engine.kv.num_blocks
        assert engine.stats.num_preemptions == 0  # nothing cut a draft
        # every plan is reported or abandoned: in the step engine exactly once; on loop passes at least once (a plan
        # whose rounds all finished before it served its last reports again for the later ones), the plan in use
        # excepted (it may wait for rounds that never came)
        heard = plan_ids.reported + plan_ids.abandoned
        if batching == "step":
            assert sorted(heard) == plan_ids.planned, (plan_ids.planned, heard)
        else:
            assert set(plan_ids.planned) - set(heard) <= set(plan_ids.planned[-1:]), (plan_ids.planned, heard)
            assert set(heard) <= set(plan_ids.planned)
        for request_id, out in finished.items():
            spec = specs[request_id]
            expected = alone_under(family, k, d, tuple(spec["prompt"]), params_of(spec).model_dump_json())
            assert (out.finish_reason, tuple(out.token_ids)) == ("length", expected), (request_id, spec)
        event(f"faults fired: {min(faulty.fired, 2)}")
    finally:
        faulty.remove()
        gc.collect()
