"""Request priority (vLLM's `--scheduling-policy priority` and request `priority`): the waiting request of the lowest
priority value is admitted first (ties by arrival), the running one of the highest is preempted first; under "fcfs"
only priority 0 is taken."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from conftest import load, reference

from looped_spec import LoopedSpecEngine, SamplingParams, SpeculativeConfig

PARAMS = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0)


def finish_order(engine: LoopedSpecEngine, priorities: list[int], params: SamplingParams = PARAMS) -> list[str]:
    """Queue one request per priority (in that order) before any step, run them, and return their ids in the order
    they finished."""
    prompts = reference("ouro")["prompts"]
    ids = [engine.add_request(prompts[i % len(prompts)], params, priority=p) for i, p in enumerate(priorities)]
    order = []
    while engine.has_unfinished_requests():
        order += [out.request_id for out in engine.step() if out.finished]
    return [str(ids.index(i)) for i in order]


@pytest.mark.parametrize("batching", ["step", "loop"])
def test_one_at_a_time_the_lowest_priority_value_runs_first_and_ties_go_by_arrival(batching):
    engine = LoopedSpecEngine(load("ouro"), speculation="off", max_batch_size=1, scheduling_policy="priority",
                              batching=batching)  # fmt: skip
    assert finish_order(engine, [1, 0, -1, 0, 5, -1]) == ["2", "5", "1", "3", "0", "4"]
    fcfs = LoopedSpecEngine(load("ouro"), speculation="off", max_batch_size=1, batching=batching)
    assert finish_order(fcfs, [0, 0, 0, 0]) == ["0", "1", "2", "3"]


@pytest.mark.parametrize("speculation", ["off", SpeculativeConfig(k=2, d=1)])
@pytest.mark.parametrize("policy", ["fcfs", "priority"])
def test_when_blocks_run_out_the_lowest_priority_is_preempted_and_outputs_stay_exact(policy, speculation):
    """Two requests outgrow a small KV cache: under "fcfs" the newer one is preempted, under "priority" the one of
    the higher priority value though it came first. Either way every output equals a roomy engine's."""
    prompts = reference("ouro")["prompts"][:2]
    params = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    roomy = LoopedSpecEngine(load("ouro"), speculation=speculation).generate(prompts, params)
    tight = LoopedSpecEngine(load("ouro"), speculation=speculation, scheduling_policy=policy, block_size=4,
                             num_kv_blocks=16, max_model_len=64)  # fmt: skip
    priority = [5, 0] if policy == "priority" else [0, 0]
    outs = tight.generate(prompts, params, priority=priority)
    assert [out.token_ids for out in outs] == [out.token_ids for out in roomy]
    preempted = [out.metrics.num_preemptions > 0 for out in outs]
    assert preempted == [True, False] if policy == "priority" else preempted == [False, True]
    assert tight.num_free_blocks == tight.kv.num_blocks


def test_a_priority_is_refused_where_it_would_do_nothing_or_is_not_an_integer():
    fcfs = LoopedSpecEngine(load("ouro"), speculation="off")
    with pytest.raises(ValueError, match=r"priority=3: .*scheduling_policy='priority'"):
        fcfs.add_request([1, 2], PARAMS, priority=3)
    with pytest.raises(ValueError, match=r"priority\[1\]=-1"):
        fcfs.generate([[1, 2], [3, 4]], PARAMS, priority=[0, -1])
    assert not fcfs.has_unfinished_requests()  # nothing of a refused call was queued
    ranked = LoopedSpecEngine(load("ouro"), speculation="off", scheduling_policy="priority")
    with pytest.raises(TypeError, match="priority must be an integer, got bool"):
        ranked.add_request([1, 2], PARAMS, priority=True)
    with pytest.raises(TypeError, match=r"priority\[0\] must be an integer, got float"):
        ranked.generate([[1, 2]], PARAMS, priority=[1.5])
    with pytest.raises(ValueError, match=r"priority: one integer per prompt \(2\), got 1 entries"):
        ranked.generate([[1, 2], [3, 4]], PARAMS, priority=[1])
    with pytest.raises(ValueError, match=r"priority: one integer per prompt \(1\), got int"):
        ranked.generate([[1, 2]], PARAMS, priority=1)
    assert not ranked.has_unfinished_requests()
    with pytest.raises(ValueError, match="scheduling_policy='lifo': Input should be 'fcfs' or 'priority'"):
        LoopedSpecEngine(load("ouro"), speculation="off", scheduling_policy="lifo")


def test_the_async_engine_refuses_a_priority_before_queueing_it():
    from looped_spec import AsyncLoopedSpecEngine

    async def main():
        with AsyncLoopedSpecEngine(LoopedSpecEngine(load("ouro"), speculation="off")) as engine:
            with pytest.raises(ValueError, match="priority=2"):
                engine.add_request([1, 2], PARAMS, priority=2)
            assert engine.num_in_flight == 0
            outs = [out async for out in engine.generate([1, 2], PARAMS, priority=0)]
            assert outs[-1].finished and len(outs[-1].token_ids) == PARAMS.max_tokens

    asyncio.run(main())


def test_the_server_takes_a_priority_only_under_the_priority_policy():
    from server_utils import ServerThread

    body = {"model": "tiny-ouro", "prompt": [1, 2, 3], "max_tokens": 4, "temperature": 0}
    chat = {"model": "tiny-ouro", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    with ServerThread(LoopedSpecEngine("tiny-ouro", speculation="off"), "tiny-ouro") as server:
        for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            refused = httpx.post(server.url + path, json={**request, "priority": 1}, timeout=60)
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "priority", refused.text
            assert httpx.post(server.url + path, json={**request, "priority": 0}, timeout=60).status_code == 200
    engine = LoopedSpecEngine("tiny-ouro", speculation="off", scheduling_policy="priority")
    with ServerThread(engine, "tiny-ouro") as server:
        for path, request in (("/v1/completions", body), ("/v1/chat/completions", chat)):
            answer = httpx.post(server.url + path, json={**request, "priority": -3}, timeout=60)
            assert answer.status_code == 200, answer.text
        typed = httpx.post(server.url + "/v1/completions", json={**body, "priority": "1"}, timeout=60)
        assert typed.status_code == 400 and "priority" in typed.text


def test_the_servers_priority_field_decides_which_waiting_request_runs_first():
    """On a server of the priority policy, one request at a time: while a long one runs, a request of priority 5 and
    then one of priority -1 wait; the later, of the lower value, runs (and finishes) first."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    from server_utils import ServerThread, wait_until

    engine = LoopedSpecEngine("tiny-ouro", speculation="off", max_batch_size=1, scheduling_policy="priority")
    step = engine.step

    def slowed_step():  # the long request surely still runs while the other two reach the engine, on a loaded machine
        time.sleep(0.02)
        return step()

    engine.step = slowed_step
    finished, generating = [], threading.Event()

    def complete(url: str, name: str, priority: int, max_tokens: int) -> None:
        body = {"model": "tiny-ouro", "prompt": f"{name}:", "max_tokens": max_tokens, "ignore_eos": True,
                "temperature": 0, "priority": priority, "stream": True}  # fmt: skip
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as answer:
            assert answer.status_code == 200
            for line in answer.iter_lines():
                generating.set()  # the first token: this request runs
                assert "error" not in line, line
        finished.append(name)

    try:
        with ServerThread(engine, "tiny-ouro") as server, ThreadPoolExecutor(3) as pool:
            running = [pool.submit(complete, server.url, "long", 0, 100)]
            assert generating.wait(60)  # the long request runs (the others wait for its place)
            for name, priority in (("five", 5), ("minus one", -1)):
                running.append(pool.submit(complete, server.url, name, priority, 2))
                # in the engine (not only admitted by the front), while the long request runs: the order is now the
                # scheduler's
                wait_until(lambda: len(engine.request_ids()) == len(running), what=f"{name} in the engine")
            for future in running:
                future.result()
        assert finished == ["long", "minus one", "five"]
    finally:
        engine.close()
