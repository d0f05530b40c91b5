"""AsyncLoopedSpecEngine without HTTP: streams equal offline generation, leaving a stream aborts it."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from conftest import make_engine
from server_utils import wait_until

from looped_spec import AsyncLoopedSpecEngine, SamplingParams
from looped_spec.engine.async_engine import EngineDeadError, QueueFullError

PROMPTS = [[1, 5, 9, 2], [3, 3, 7], [8, 1, 4, 4, 6]]


def test_concurrent_streams_equal_offline_generate_and_abort_frees_kv():
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in make_engine("ouro").generate(PROMPTS, params)]
    engine = make_engine("ouro", speculation="2,1", max_batch_size=4)
    front = AsyncLoopedSpecEngine(engine, max_queued=0)

    async def collect(prompt) -> list[int]:
        tokens = []
        async for out in front.generate(prompt, sampling_params=params):  # vLLM's AsyncLLM.generate keyword
            tokens += out.new_token_ids
            assert out.token_ids == tokens
        return tokens

    async def leave_early() -> int:
        seen = 0
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        async with aclosing(front.generate([2, 2, 2], long)) as stream:
            async for out in stream:
                seen += len(out.new_token_ids)
                break  # leaving the stream aborts the request
        return seen

    async def run():
        results = await asyncio.gather(*(collect(p) for p in PROMPTS), leave_early())
        assert front.num_in_flight == 0
        return results

    front.start()
    try:
        *streams, seen = asyncio.run(run())
        assert streams == expected and seen >= 1
        wait_until(lambda: engine.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished_requests())
    finally:
        front.shutdown()


def test_admission_is_bounded():
    engine = make_engine("ouro", max_batch_size=1)
    front = AsyncLoopedSpecEngine(engine, max_queued=1)
    front.start()

    async def run():
        params = SamplingParams(max_tokens=4, ignore_eos=True)
        first, second = front.add_request([1, 2], params), front.add_request([3, 4], params)
        with pytest.raises(QueueFullError):
            front.add_request([5, 6], params)
        return [out async for out in first][-1], [out async for out in second][-1]

    try:
        outs = asyncio.run(run())
        assert [len(o.token_ids) for o in outs] == [4, 4]
        # outside an event loop: an error saying where to call it from (asyncio's was "no running event loop")
        with pytest.raises(RuntimeError, match="call it from a coroutine"):
            front.add_request([1, 2], SamplingParams(max_tokens=4))
    finally:
        front.shutdown()


def test_scores_hold_a_place_in_admission_and_a_cancelled_one_is_skipped():
    """A score is a whole-sequence forward: it counts among the in-flight requests while it waits or runs (so an
    evaluation client cannot queue unbounded work), and one whose caller left before the worker got to it never
    runs."""
    import threading

    engine = make_engine("ouro", max_batch_size=1)
    ran: list[list[int]] = []
    real_score = engine.score
    release = threading.Event()

    def score(token_ids, top_n=0, seed=0):
        ran.append(list(token_ids))
        release.wait(30)  # the worker holds here until the test lets it go
        return real_score(token_ids, top_n, seed)

    engine.score = score
    front = AsyncLoopedSpecEngine(engine, max_queued=1)  # two in flight at most
    front.start()

    async def run():
        params = SamplingParams(max_tokens=2, ignore_eos=True)
        first = asyncio.ensure_future(front.score([1, 2, 3], 1))
        await asyncio.sleep(0)
        second = asyncio.ensure_future(front.score([4, 5, 6], 1))
        await asyncio.sleep(0)
        assert front.num_in_flight == 2
        with pytest.raises(QueueFullError):
            front.add_request([7, 8], params)
        with pytest.raises(QueueFullError):
            await front.score([9, 9], 1)
        wait_until(lambda: len(ran) == 1, what="the first score running")
        second.cancel()  # its caller leaves while the worker is busy with the first
        await asyncio.gather(second, return_exceptions=True)
        release.set()
        scores = await first
        assert front.num_in_flight == 0 and len(scores) == 3 and scores[0] is None
        # the worker got to the cancelled score after the first and skipped it; the next one runs
        assert len(await front.score([2, 2], 1)) == 2
        return [out async for out in front.add_request([7, 8], params)][-1]

    try:
        out = asyncio.run(run())
        assert len(out.token_ids) == 2
        assert ran == [[1, 2, 3], [2, 2]]
    finally:
        release.set()
        front.shutdown()


def test_end_all_ends_streams_and_waiting_scores_and_admits_nothing_more():
    """What a server shutting down calls: open streams end with EngineDeadError (their requests aborted, KV freed),
    scores still waiting end the same way, and nothing more is admitted."""
    import threading

    from looped_spec.engine.async_engine import EngineDeadError

    engine = make_engine("ouro", max_batch_size=2)
    release = threading.Event()
    real_score = engine.score

    def score(token_ids, top_n=0, seed=0):
        release.wait(30)  # the worker is busy with this score when end_all comes
        return real_score(token_ids, top_n, seed)

    engine.score = score
    front = AsyncLoopedSpecEngine(engine, max_queued=4)
    front.start()

    async def run():
        stream = front.add_request([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        busy = asyncio.ensure_future(front.score([4, 5], 1))
        waiting = asyncio.ensure_future(front.score([6, 7], 1))
        await asyncio.sleep(0.05)
        front.end_all("the server is shutting down")
        with pytest.raises(EngineDeadError, match="shutting down"):
            async for _ in stream:
                pass
        for future in (busy, waiting):
            with pytest.raises(EngineDeadError, match="shutting down"):
                await future
        with pytest.raises(EngineDeadError, match="shutting down"):
            front.add_request([1], SamplingParams(max_tokens=2))
        with pytest.raises(EngineDeadError, match="shutting down"):
            await front.score([1, 2], 1)

    try:
        asyncio.run(run())
        # the worker finishes the busy score only now, after the caller's event loop closed: it must survive that
        # and go on to abort the ended stream's request
        release.set()
        wait_until(lambda: engine.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished_requests())
        assert front.is_running
    finally:
        release.set()
        front.shutdown()
    with pytest.raises(EngineDeadError, match="shutting down"):  # end_all's reason stays the one given
        front.add_request([1], SamplingParams(max_tokens=2))


def test_an_abort_ends_the_stream_a_task_is_reading_and_its_id_is_reused_once_released():
    engine = make_engine("ouro", speculation="off")
    front = AsyncLoopedSpecEngine(engine)
    front.start()
    long, short = SamplingParams(max_tokens=400, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)
    expected = make_engine("ouro", speculation="off").generate([PROMPTS[1]], short)[0].token_ids

    async def run():
        stream = front.add_request(PROMPTS[0], long, request_id="X")
        seen: list = []
        reading = asyncio.create_task(_drain(stream, seen))
        while not seen:  # reading: then aborted from elsewhere while it waits for the next output
            await asyncio.sleep(0.01)
        front.abort("X")
        await asyncio.wait_for(reading, 10)  # the reader stops (it waited for ever before)
        assert stream.finished and not any(out.finished for out in seen)
        with pytest.raises(ValueError, match="request_id 'X' was just aborted and is still being released"):
            front.add_request(PROMPTS[1], short, request_id="X")  # the engine may still hold the old one
        for _ in range(500):  # free once the worker's next step handed the old request back
            try:
                again = front.add_request(PROMPTS[1], short, request_id="X")
                break
            except ValueError:
                await asyncio.sleep(0.01)
        outs = [out async for out in again]
        assert outs[-1].token_ids == expected and outs[-1].prompt_token_ids == PROMPTS[1]  # its own request's
        numbered = [out async for out in front.add_request(PROMPTS[1], short, request_id=7)]  # ids are strings
        assert numbered[-1].request_id == "7" and numbered[-1].token_ids == expected

    try:
        asyncio.run(run())
    finally:
        front.shutdown()
    with pytest.raises(Exception, match="the engine was shut down"):
        front.start()  # a closed engine cannot serve again


def test_abort_takes_several_ids_and_a_front_says_how_to_start(caplog):
    """vLLM's abort takes a list: each request stops (a list was read as one unknown id, and nothing stopped); a front
    built on something else, or used before start(), says what to do."""
    with pytest.raises(TypeError, match=r"engine: a LoopedSpecEngine, got str \(AsyncLoopedSpecEngine\("):
        AsyncLoopedSpecEngine("tiny-ouro")
    engine = make_engine("ouro", speculation="off")
    front = AsyncLoopedSpecEngine(engine)
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def before_start():
        with pytest.raises(EngineDeadError, match=r"not running: start\(\) it, or use `with AsyncLoopedSpecEngine"):
            front.add_request(PROMPTS[0], long)

    asyncio.run(before_start())

    async def run():
        streams = [front.add_request(PROMPTS[i], long, request_id=f"r{i}") for i in range(2)]
        seen: list = []
        readers = [asyncio.create_task(_drain(stream, seen)) for stream in streams]
        while len(seen) < 2:
            await asyncio.sleep(0.01)
        front.abort(["r0", "r1"])
        await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert all(stream.finished for stream in streams) and not any(out.finished for out in seen)

    with front:
        asyncio.run(run())
        wait_until(lambda: engine.num_free_blocks == engine.kv.num_blocks)


async def _drain(stream, seen: list) -> None:
    async for out in stream:
        seen.append(out)


def test_a_worker_ended_by_a_base_exception_ends_every_stream_and_score(monkeypatch):
    """A BaseException out of a step (SystemExit, KeyboardInterrupt: no step handler catches them) ends the worker; its
    open streams and waiting scores end with EngineDeadError instead of waiting for it for good."""
    import threading

    class Fatal(BaseException):
        pass

    engine = make_engine("ouro", max_batch_size=2)
    entered, release = threading.Event(), threading.Event()
    real_step = engine.step

    def step():
        real_step()  # a step that ran, then the exception
        entered.set()
        release.wait(30)  # the stream and the score are both waiting when the step dies
        raise Fatal("stop")

    monkeypatch.setattr(engine, "step", step)
    caught: list = []
    monkeypatch.setattr(threading, "excepthook", lambda args: caught.append(args.exc_type))
    front = AsyncLoopedSpecEngine(engine, max_queued=4)
    front.start()

    async def run():
        stream = front.add_request([1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True))
        await asyncio.to_thread(entered.wait, 30)
        waiting = asyncio.ensure_future(front.score([4, 5], 1))
        await asyncio.sleep(0.05)
        release.set()
        with pytest.raises(EngineDeadError, match="worker stopped: Fatal: stop"):
            async for _ in stream:
                pass
        with pytest.raises(EngineDeadError, match="worker stopped"):
            await asyncio.wait_for(waiting, 30)
        with pytest.raises(EngineDeadError):
            front.add_request([1], SamplingParams(max_tokens=2))

    try:
        asyncio.run(asyncio.wait_for(run(), 20))
        wait_until(lambda: not front.is_running)
        assert caught == [Fatal]  # raised on, as the thread's own end
        # once the worker is gone a request is told why, not to start() it (start() cannot revive it)
        with pytest.raises(EngineDeadError, match="worker stopped: Fatal: stop"):
            front.add_request([1], SamplingParams(max_tokens=2))
    finally:
        release.set()
        front.shutdown()


def test_a_fault_in_a_score_is_an_engine_fault_and_the_worker_goes_on(monkeypatch):
    from looped_spec.engine.async_engine import EngineFaultError

    engine = make_engine("ouro", speculation="off")
    front = AsyncLoopedSpecEngine(engine)
    monkeypatch.setattr(engine.adapter, "dense_logit_chunks", failing_once(engine.adapter.dense_logit_chunks))

    async def run():
        with pytest.raises(EngineFaultError, match="engine error: RuntimeError: injected"):
            await front.score(PROMPTS[0])
        with pytest.raises(ValueError):  # the caller's own error stays what it is
            await front.score(PROMPTS[0], top_n=-1)
        return await front.score(PROMPTS[0])

    front.start()
    try:
        assert asyncio.run(run()) == make_engine("ouro").score(PROMPTS[0])
    finally:
        front.shutdown()


@pytest.mark.parametrize("error", [ValueError, TypeError])
def test_a_value_error_out_of_the_models_score_is_a_fault_and_the_callers_errors_stay_theirs(monkeypatch, error):
    """Model code can raise ValueError or TypeError too: in a score that is a fault (EngineFaultError, a 500 on the
    server), not the caller's bad argument (it was delivered as one: a 400). The caller's own errors, naming the
    argument, stay what they are, and come before the score is queued."""
    from looped_spec.engine.async_engine import EngineFaultError

    engine = make_engine("ouro", speculation="off")
    front = AsyncLoopedSpecEngine(engine)
    monkeypatch.setattr(engine.adapter, "dense_logit_chunks", failing_once(engine.adapter.dense_logit_chunks, error))
    bad = [(([1, 10**6],), ValueError, "token_ids"), (("1 2",), TypeError, "token_ids"),
           ((PROMPTS[0], -1), ValueError, "top_n"), ((PROMPTS[0], 1, -1), ValueError, "seed")]  # fmt: skip

    async def run():
        with pytest.raises(EngineFaultError, match=f"engine error: {error.__name__}: injected"):
            await front.score(PROMPTS[0], 2)
        for args, caller_error, field in bad:
            with pytest.raises(caller_error, match=field):
                await front.score(*args)
        assert front.num_in_flight == 0
        return await front.score(PROMPTS[0], 2)

    with front:
        assert asyncio.run(run()) == make_engine("ouro", speculation="off").score(PROMPTS[0], 2)


@pytest.mark.parametrize("error", [RuntimeError, ValueError])
def test_a_fault_while_a_request_is_admitted_is_an_engine_fault_and_the_worker_goes_on(monkeypatch, error):
    """prompt_logprobs are a forward run when the worker admits the request: a fault there is the engine's
    (EngineFaultError, a 500 or an error event on the server), not the request's refusal (it reached the stream as the
    bare RuntimeError, which the server does not answer; a ValueError out of model code, as the request's own)."""
    from looped_spec.engine.async_engine import EngineFaultError

    engine = make_engine("ouro", speculation="off")
    monkeypatch.setattr(engine.adapter, "dense_logit_chunks", failing_once(engine.adapter.dense_logit_chunks, error))
    params = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1)

    async def run():
        with pytest.raises(EngineFaultError, match="engine error: RuntimeError: .*injected"):
            async for _ in front.generate(PROMPTS[0], params):
                pass
        with pytest.raises(ValueError, match="outside the vocabulary"):  # the request's own error stays what it is
            async for _ in front.generate([1, 10**6], params):
                pass
        return [out async for out in front.generate(PROMPTS[0], params)][-1]

    with AsyncLoopedSpecEngine(engine) as front:
        out = asyncio.run(run())
    assert out.finish_reason == "length" and len(out.prompt_logprobs) == len(PROMPTS[0])


def failing_once(real, error: type[Exception] = RuntimeError):
    """`real`, except that its first call raises `error`("injected")."""
    calls = []

    def call(*args, **kwargs):
        calls.append(None)
        if len(calls) == 1:
            raise error("injected")
        return real(*args, **kwargs)

    return call


def test_a_request_racing_shutdown_is_refused_or_ended_never_left_waiting(monkeypatch):
    """A handler thread can pass the running check just before shutdown() stops the worker and ends every stream: the
    request it then registers must be refused (as on a closed front), not left waiting for a worker that is gone."""
    import threading

    engine = make_engine("ouro", speculation="off")
    front = AsyncLoopedSpecEngine(engine)
    checked, go = threading.Event(), threading.Event()
    real_check = engine.check_priority

    def check_priority(priority, field="priority"):  # runs after the running check: shutdown() happens here
        checked.set()
        go.wait(30)
        return real_check(priority, field)

    monkeypatch.setattr(engine, "check_priority", check_priority)

    async def request():
        return [out async for out in front.add_request(PROMPTS[0], SamplingParams(max_tokens=2, ignore_eos=True))]

    async def race():
        return await asyncio.wait_for(request(), 10)

    results: list = []
    front.start()
    racer = threading.Thread(target=lambda: results.append(_outcome(lambda: asyncio.run(race()))))
    racer.start()
    try:
        assert checked.wait(30)
        front.shutdown()
    finally:
        go.set()
        racer.join(30)
    [outcome] = results
    assert isinstance(outcome, EngineDeadError) and "shut down" in str(outcome), outcome


def _outcome(call):
    try:
        return call()
    except BaseException as exc:  # noqa: BLE001 - the outcome is what the test checks
        return exc


def test_a_caller_chosen_id_is_not_reused_before_a_failed_flush_hands_the_old_request_back(monkeypatch):
    """Steps failing past the engine's rule end every request; when the step that would hand the aborted requests
    back fails too, the engine still holds them: a new request under the same id must get its own outputs (it got
    the old request's abort, or the engine's refusal of a duplicate id), waiting until the id is free."""
    import threading

    from looped_spec.engine.async_engine import EngineFaultError

    engine = make_engine("ouro", speculation="off")
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = make_engine("ouro", speculation="off").generate([PROMPTS[1]], short)[0].token_ids
    real_step = engine.step
    failing = engine.FAILURES_TO_BLAME * 2 + 1 + 1  # past the rule for one request, then the flush fails as well
    calls, added = [], threading.Event()

    def step():
        calls.append(None)
        if len(calls) <= failing:
            raise RuntimeError("injected")
        added.wait(30)  # the first step after the failed flush waits until the id was asked for again
        return real_step()

    monkeypatch.setattr(engine, "step", step)

    async def run():
        with pytest.raises(EngineFaultError, match="injected"):
            async for _ in front.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True), "X"):
                pass
        for _ in range(500):
            try:
                again = front.add_request(PROMPTS[1], short, request_id="X")
                break
            except ValueError:  # still being released: the step that hands the old request back is held
                added.set()
                await asyncio.sleep(0.01)
        added.set()
        return [out async for out in again]

    with AsyncLoopedSpecEngine(engine) as front:
        outs = asyncio.run(asyncio.wait_for(run(), 30))
    assert outs[-1].finish_reason == "length" and outs[-1].prompt_token_ids == PROMPTS[1]
    assert outs[-1].token_ids == expected


def test_step_faults_follow_the_engines_rule_through_the_front(monkeypatch):
    """Faults in steps the worker runs: a request whose every step fails (its own sampling) is finished with an error
    after failing alone twice, and a one-shot model fault after that is retried by the engine's rule. Every stream
    ends once, with its own output: the others' equal the clean run, each token delivered once; the failing one's
    ends with finish_reason "error" and the message; the worker goes on."""
    from looped_spec.execution.sampler import SamplingRows

    params = SamplingParams(max_tokens=16, ignore_eos=True)
    expected = [o.token_ids for o in make_engine("ouro", speculation="2,1").generate(PROMPTS, params)]
    engine = make_engine("ouro", speculation="2,1", max_batch_size=4)
    original = SamplingRows.build.__func__

    def build(cls, requests, device, drafted=None):  # a fault only the request "bad" hits, every time
        if any(r.request_id == "bad" for r in requests):
            raise RuntimeError("bad request")
        return original(cls, requests, device, drafted)

    monkeypatch.setattr(SamplingRows, "build", classmethod(build))
    real_loop, loop_faults = engine.adapter.loop, []

    def loop(*args, **kwargs):  # once "bad" was finished with its error, one model fault, once
        if engine.stats.num_requests_failed and not loop_faults:
            loop_faults.append(None)
            raise RuntimeError("one-shot")
        return real_loop(*args, **kwargs)

    monkeypatch.setattr(engine.adapter, "loop", loop)

    async def collect(prompt, request_id) -> list:
        return [out async for out in front.add_request(prompt, params, request_id=request_id)]

    async def run():
        ids = ["a", "b", "c", "bad"]
        return dict(zip(ids, await asyncio.gather(*(collect(p, i) for p, i in zip([*PROMPTS, PROMPTS[0]], ids)))))

    with AsyncLoopedSpecEngine(engine) as front:
        streams = asyncio.run(asyncio.wait_for(run(), 60))
        assert loop_faults and front.num_in_flight == 0
        wait_until(lambda: engine.num_free_blocks == engine.kv.num_blocks and not engine.has_unfinished_requests())
        again = asyncio.run(asyncio.wait_for(collect(PROMPTS[1], "d"), 30))  # the worker goes on
    for outs in streams.values():  # one finished output, the last; every token once
        assert [out.finished for out in outs] == [False] * (len(outs) - 1) + [True]
        assert [t for out in outs for t in out.new_token_ids] == outs[-1].token_ids
    finals = [streams[i][-1] for i in "abc"]
    assert [(o.finish_reason, o.token_ids) for o in finals] == [("length", t) for t in expected]
    bad = streams["bad"][-1]
    assert bad.finish_reason == "error" and "bad request" in bad.error
    assert again[-1].token_ids == expected[1]


def test_leaving_a_stream_whose_request_finished_leaves_a_newer_request_of_its_id_running():
    """A client that read a request's outputs but its last, then went away after a caller reused the id (free once the
    request finished): leaving the old stream aborted the new request, whose stream ended with nothing."""
    engine = make_engine("ouro", speculation="off")
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = make_engine("ouro", speculation="off").generate([PROMPTS[1]], params)[0].token_ids

    async def run():
        reader = front.add_request(PROMPTS[0], params, request_id="a").__aiter__()
        assert not (await reader.__anext__()).finished
        for _ in range(500):  # free once the worker delivered the old request's last output (left unread)
            try:
                again = front.add_request(PROMPTS[1], params, request_id="a")
                break
            except ValueError:
                await asyncio.sleep(0.01)
        await reader.aclose()  # the first client goes away
        return [out async for out in again]

    with AsyncLoopedSpecEngine(engine) as front:
        outs = asyncio.run(asyncio.wait_for(run(), 30))
    assert outs and outs[-1].finish_reason == "length" and outs[-1].token_ids == expected


def test_a_fault_retried_up_to_the_rules_bound_costs_the_stream_nothing_and_the_count_restarts(monkeypatch):
    """The front ends every stream only after more steps failed in a row than the engine's rule can take to blame
    every request (FAILURES_TO_BLAME x (requests + 1)): a fault failing exactly that many steps is retried and the
    stream gets plain decoding's tokens; one more ends it with EngineFaultError; and after that the count starts
    again (a one-shot fault of the next request is retried, not taken as one more in the same row)."""
    from looped_spec.engine.async_engine import EngineFaultError

    engine = make_engine("ouro", speculation="off")
    short = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = make_engine("ouro", speculation="off").generate([PROMPTS[1]], short)[0].token_ids
    bound = engine.FAILURES_TO_BLAME * (1 + 1)  # one request in the engine
    faults = {"at-bound": bound, "past-bound": bound + 1, "after": 1}  # steps to fail while the request is held
    real_step = engine.step

    def step():
        for request_id in engine.request_ids():
            if faults.get(request_id):
                faults[request_id] -= 1
                raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(engine, "step", step)

    async def collect(request_id) -> list:
        return [out async for out in front.add_request(PROMPTS[1], short, request_id=request_id)]

    async def run():
        at_bound = await collect("at-bound")
        with pytest.raises(EngineFaultError, match="injected"):
            await collect("past-bound")
        return at_bound, await collect("after")

    with AsyncLoopedSpecEngine(engine) as front:
        at_bound, after = asyncio.run(asyncio.wait_for(run(), 30))
    assert at_bound[-1].finish_reason == "length" and at_bound[-1].token_ids == expected
    assert after[-1].finish_reason == "length" and after[-1].token_ids == expected


def test_abort_leaving_and_end_all_stop_the_request_in_the_engine(monkeypatch):
    """Each way a stream ends early stops its request in the engine (finish reason "abort" in its counts, KV freed),
    not only the stream while the engine runs the request on to max_tokens."""
    import threading

    engine = make_engine("ouro", speculation="off", max_batch_size=4)
    held, release = threading.Event(), threading.Event()
    real_score = engine.score

    def score(token_ids, top_n=0, seed=0):  # holds the worker between two steps while the streams end
        held.set()
        release.wait(30)
        return real_score(token_ids, top_n, seed)

    monkeypatch.setattr(engine, "score", score)
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def run():
        readers = [front.add_request(PROMPTS[i], long, request_id=f"r{i}").__aiter__() for i in range(3)]
        for reader in readers:  # each request is running
            assert not (await reader.__anext__()).finished
        scoring = asyncio.ensure_future(front.score([1, 2], 1))
        await asyncio.to_thread(held.wait, 30)
        front.abort("r0")
        await readers[1].aclose()  # its reader leaves
        front.end_all("the server is shutting down")  # r2's stream is still open
        release.set()
        with pytest.raises(EngineDeadError, match="shutting down"):  # after the outputs it had not read
            async for _ in readers[2]:
                pass
        with pytest.raises(EngineDeadError, match="shutting down"):
            await scoring

    with AsyncLoopedSpecEngine(engine) as front:
        asyncio.run(asyncio.wait_for(run(), 30))
        wait_until(lambda: not engine.has_unfinished_requests() and engine.num_free_blocks == engine.kv.num_blocks)
        assert dict(engine.stats.finished_reasons) == {"abort": 3}


def test_an_id_the_front_picks_skips_one_a_caller_chose_that_is_still_being_released(monkeypatch):
    """A request without an id gets a free one: not "req-0" while a caller's own "req-0" was just aborted and the
    engine may still hold it (it was refused as "just aborted ... retry", which the caller could do nothing about)."""
    import threading

    engine = make_engine("ouro", speculation="off")
    held, release = threading.Event(), threading.Event()
    real_score = engine.score

    def score(token_ids, top_n=0, seed=0):  # holds the worker: the abort is not applied yet
        held.set()
        release.wait(30)
        return real_score(token_ids, top_n, seed)

    monkeypatch.setattr(engine, "score", score)
    short = SamplingParams(max_tokens=3, ignore_eos=True)
    expected = make_engine("ouro", speculation="off").generate([PROMPTS[1]], short)[0].token_ids

    async def run():
        scoring = asyncio.ensure_future(front.score([1, 2], 1))
        await asyncio.to_thread(held.wait, 30)
        front.add_request(PROMPTS[0], short, request_id="req-0")
        front.abort("req-0")
        stream = front.add_request(PROMPTS[1], short)
        release.set()
        await scoring
        return [out async for out in stream]

    with AsyncLoopedSpecEngine(engine) as front:
        outs = asyncio.run(asyncio.wait_for(run(), 30))
    assert outs[-1].request_id != "req-0" and outs[-1].token_ids == expected


def test_steps_failing_past_the_rule_end_the_requests_the_engine_holds_and_free_their_ids(monkeypatch):
    """Past the rule the front ends what the engine holds: those requests are aborted in the engine (KV freed, finish
    reason "abort"; one a caller aborted while the steps failed among them) and their ids are free again once it
    handed them back; a request added while the last step failed (the engine does not hold it yet) is not ended."""
    import threading

    from looped_spec.engine.async_engine import EngineFaultError

    engine = make_engine("ouro", speculation="off", max_batch_size=4)
    short, long = SamplingParams(max_tokens=4, ignore_eos=True), SamplingParams(max_tokens=400, ignore_eos=True)
    expected = make_engine("ouro", speculation="off").generate([PROMPTS[1]], short)[0].token_ids
    past_rule = engine.FAILURES_TO_BLAME * (2 + 1) + 1  # with "doomed" and "left" in the engine
    held = {1: (threading.Event(), threading.Event()), past_rule: (threading.Event(), threading.Event())}
    failed: list = []
    real_step = engine.step

    def step():
        if len(failed) < past_rule and {"doomed", "left"} <= set(engine.request_ids()):
            failed.append(None)
            if len(failed) in held:  # the first and the last failing step: callers act while it fails
                failing, go = held[len(failed)]
                failing.set()
                go.wait(30)
            raise RuntimeError("injected")
        return real_step()

    monkeypatch.setattr(engine, "step", step)

    async def step_failing(number):
        failing, go = held[number]
        await asyncio.to_thread(failing.wait, 30)
        return go

    async def reuse(request_id):
        for _ in range(500):
            try:
                return [out async for out in front.add_request(PROMPTS[1], short, request_id=request_id)]
            except ValueError:  # free once the engine handed the aborted request back
                await asyncio.sleep(0.01)
        pytest.fail(f"the id {request_id!r} of a request ended past the rule never became free")

    async def run():
        doomed = front.add_request(PROMPTS[0], long, request_id="doomed")
        front.add_request(PROMPTS[2], long, request_id="left")
        go = await step_failing(1)
        front.abort("left")  # applied in the engine before the last failing step
        go.set()
        go = await step_failing(past_rule)
        bystander = front.add_request(PROMPTS[1], short, request_id="bystander")
        go.set()
        with pytest.raises(EngineFaultError, match="injected"):
            async for _ in doomed:
                pass
        return [out async for out in bystander], await reuse("doomed"), await reuse("left")

    with AsyncLoopedSpecEngine(engine) as front:
        streams = asyncio.run(asyncio.wait_for(run(), 30))
        wait_until(lambda: not engine.has_unfinished_requests() and engine.num_free_blocks == engine.kv.num_blocks)
        assert dict(engine.stats.finished_reasons) == {"abort": 2, "length": 3}
    for outs in streams:
        assert outs[-1].finish_reason == "length" and outs[-1].token_ids == expected


def test_a_score_queued_behind_the_last_step_ends_with_shutdown(monkeypatch):
    """shutdown() stops the worker after its current step: a score queued behind that step never runs, and ends with
    EngineDeadError instead of leaving its caller waiting for good."""
    import threading

    engine = make_engine("ouro", speculation="off")
    stepping, release = threading.Event(), threading.Event()
    real_step = engine.step

    def step():
        stepping.set()
        release.wait(30)
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    front = AsyncLoopedSpecEngine(engine)
    front.start()

    async def run():
        stream = front.add_request(PROMPTS[0], SamplingParams(max_tokens=50, ignore_eos=True))
        await asyncio.to_thread(stepping.wait, 30)
        waiting = asyncio.ensure_future(front.score([1, 2], 1))
        await asyncio.sleep(0)  # queued
        stopping = asyncio.ensure_future(asyncio.to_thread(front.shutdown))
        while True:  # until shutdown() refuses new work (it then stops the worker)
            try:
                front.add_request([1], SamplingParams(max_tokens=1))
            except EngineDeadError:
                break
            await asyncio.sleep(0.01)
        release.set()
        await stopping
        with pytest.raises(EngineDeadError, match="shut down"):
            await asyncio.wait_for(waiting, 10)
        with pytest.raises(EngineDeadError, match="shut down"):
            async for _ in stream:
                pass

    try:
        asyncio.run(asyncio.wait_for(run(), 30))
    finally:
        release.set()
        front.shutdown()


def test_an_id_aborted_while_a_step_runs_stays_taken_until_the_engine_hands_its_request_back(monkeypatch):
    """An abort that lands while a step runs: that step's output of the request is not its last (the engine finishes
    it with the next step). Its id must stay taken until then, or a new request of the id gets the old one's abort
    output (and its own outputs go nowhere)."""
    import threading

    engine = make_engine("ouro", speculation="off")
    long, short = SamplingParams(max_tokens=400, ignore_eos=True), SamplingParams(max_tokens=4, ignore_eos=True)
    expected = make_engine("ouro", speculation="off").generate([PROMPTS[1]], short)[0].token_ids
    plan: list = []  # (when, entered, go): hold the worker after or before a step's computation
    real_step = engine.step

    def step():
        if not plan:
            return real_step()
        when, entered, go = plan.pop(0)
        if when == "before":
            entered.set()
            go.wait(30)
            return real_step()
        outputs = real_step()
        entered.set()
        go.wait(30)
        return outputs

    monkeypatch.setattr(engine, "step", step)
    after, before = (threading.Event(), threading.Event()), (threading.Event(), threading.Event())

    async def run():
        reader = front.add_request(PROMPTS[0], long, request_id="X").__aiter__()
        assert not (await reader.__anext__()).finished
        plan.extend([("after", *after), ("before", *before)])
        await asyncio.to_thread(after[0].wait, 30)  # a step of X ran; its outputs are not delivered yet
        front.abort("X")
        after[1].set()
        await asyncio.to_thread(before[0].wait, 30)  # the step that hands X back has not run
        try:
            again = front.add_request(PROMPTS[1], short, request_id="X")
        except ValueError:  # still being released
            again = None
        before[1].set()
        for _ in range(500):
            if again is not None:
                break
            try:
                again = front.add_request(PROMPTS[1], short, request_id="X")
            except ValueError:
                await asyncio.sleep(0.01)
        return [out async for out in again]

    with AsyncLoopedSpecEngine(engine) as front:
        outs = asyncio.run(asyncio.wait_for(run(), 30))
    assert outs[-1].prompt_token_ids == PROMPTS[1] and outs[-1].finish_reason == "length"
    assert outs[-1].token_ids == expected


def test_abort_is_awaited_as_vllm_code_writes_it():
    """vLLM's `AsyncLLM.abort` is a coroutine, so its users write `await engine.abort(request_id)`: it stops the request
    here too (it was a TypeError, None not being awaitable, after the abort), and a call without await still does."""
    engine = make_engine("ouro", speculation="off")
    long = SamplingParams(max_tokens=400, ignore_eos=True)

    async def run():
        seen: list = []
        readers = [asyncio.create_task(_drain(front.add_request(PROMPTS[i], long, request_id=f"r{i}"), seen))
                   for i in range(3)]  # fmt: skip
        while len(seen) < 3:
            await asyncio.sleep(0.01)
        assert await front.abort("r0") is None
        await front.abort(["r1"])
        front.abort("r2")
        await asyncio.wait_for(asyncio.gather(*readers), 10)
        assert front.num_in_flight == 0

    with AsyncLoopedSpecEngine(engine) as front:
        asyncio.run(run())
        wait_until(lambda: engine.num_free_blocks == engine.kv.num_blocks)


def test_health_is_read_as_vllm_code_reads_it():
    """vLLM's `await engine.check_health()` (raises `engine.dead_error` once `engine.errored`), `is_running` and
    `is_stopped`, which a service wrapping AsyncLLM polls: here too (each was an AttributeError), the error saying why
    it is not running (not started, shut down, its worker dead)."""
    engine = make_engine("ouro", speculation="off")
    front = AsyncLoopedSpecEngine(engine)

    async def health() -> str | None:
        try:
            await front.check_health()
        except EngineDeadError as exc:
            assert str(exc) == str(front.dead_error)
            return str(exc)
        return None

    assert front.errored and front.is_stopped and not front.is_running
    assert "not running: start() it" in asyncio.run(health())
    with front:
        assert not front.errored and not front.is_stopped and front.is_running
        assert asyncio.run(health()) is None
        front.end_all("the server is shutting down")  # admits nothing more: unhealthy, though its worker runs
        assert front.errored and asyncio.run(health()) == "the server is shutting down"
    assert front.errored and asyncio.run(health()) == "the server is shutting down"
    other = AsyncLoopedSpecEngine(make_engine("ouro", speculation="off"))
    other.start()
    other.shutdown()
    assert other.errored and isinstance(other.dead_error, EngineDeadError)
    assert "the engine was shut down" in str(other.dead_error)


def test_health_read_while_shutdown_clears_the_worker_answers():
    """errored / is_running / check_health are read from any thread (a health probe) while shutdown() on another
    sets the worker thread to None after joining it: a read between the two looks at it once (it read it twice,
    `self._thread is not None and self._thread.is_alive()`, and raised AttributeError on None)."""

    class ShutDownBetweenReads(AsyncLoopedSpecEngine):
        @property
        def _thread(self):  # the live worker at the first read, None (shutdown() done) at every later one
            return self.__dict__.pop("reads", [None]).pop(0) if "reads" in self.__dict__ else None

        @_thread.setter
        def _thread(self, value):
            pass

    class Alive:
        def is_alive(self) -> bool:
            return True

    front = ShutDownBetweenReads(make_engine("ouro", speculation="off"))
    front.__dict__["reads"] = [Alive()]
    assert front.is_running
    front.__dict__["reads"] = [Alive()]
    assert not front.errored
    front.__dict__["reads"] = [Alive()]
    asyncio.run(front.check_health())


def test_get_tokenizer_is_the_engines_as_vllm_code_reads_it():
    """vLLM's `engine.get_tokenizer()` (and its `tokenizer`) on the async front: the checkpoint's tokenizer, read
    without a step (it was an AttributeError: only the wrapped engine had it)."""
    from looped_spec import LoopedSpecEngine

    engine = LoopedSpecEngine("tiny-ouro", speculation="off", max_model_len=128)  # the shipped one has a tokenizer
    with AsyncLoopedSpecEngine(engine) as front:
        assert front.get_tokenizer() is engine.get_tokenizer() is front.tokenizer
        assert front.get_tokenizer().decode(front.get_tokenizer().encode("def add")) == "def add"
    assert AsyncLoopedSpecEngine(make_engine("ouro")).get_tokenizer() is None  # built without tokenizer files


def test_lora_request_none_is_vllms_default_and_a_lora_is_refused_naming_it():
    """vLLM's `generate(..., lora_request=None)`, its default, runs as without it (it was a TypeError: unexpected
    keyword); a LoRA asked for is an error naming lora_request, before anything is queued."""
    engine = make_engine("ouro", speculation="off")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    expected = make_engine("ouro").generate([PROMPTS[0]], params)[0].token_ids

    async def run():
        outs = [out async for out in front.generate(PROMPTS[0], params, "a", lora_request=None)]
        assert outs[-1].token_ids == expected
        with pytest.raises(ValueError, match="lora_request: LoRA adapters are not supported"):
            async for _ in front.generate(PROMPTS[0], params, "b", lora_request=object()):
                pass
        assert front.num_in_flight == 0

    with AsyncLoopedSpecEngine(engine) as front:
        asyncio.run(run())


def test_vllms_output_kind_is_refused_saying_what_each_kind_reads_here():
    """vLLM's streaming example sets `output_kind=RequestOutputKind.DELTA`: not a field here, and the error says what
    a stream's outputs already hold for each kind (it spoke of step() alone, and of no FINAL_ONLY)."""
    from pydantic import ValidationError

    for kind in (0, 1, 2):  # CUMULATIVE, DELTA, FINAL_ONLY
        with pytest.raises(ValidationError) as caught:
            SamplingParams(max_tokens=8, output_kind=kind)
        message = str(caught.value)
        assert "output_kind: not a field here" in message and "generate()" in message
        assert "CUMULATIVE: outputs[0].text" in message and "DELTA: new_text, new_token_ids" in message
        assert "FINAL_ONLY: the output whose finished is True" in message
