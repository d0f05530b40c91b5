"""The async front (AsyncLoopedSpecEngine) under random interleavings of client actions, against plain decoding.

Random sequences of: add a request (greedy or sampled with a seed, various max_tokens and stops, sometimes under a
request id another request had), read its stream partly or to the end, leave it (the client went away), abort it
(before the worker saw it, while it runs, after it finished), arm a one-shot fault in model code, add a request that
poisons every step it is in; then end either by reading every stream to its end and shutting down, or by shutting
down with streams still open. Checked (docs/architecture.md, "Failure semantics", and the server's failure policy):
every stream ends exactly once, never hanging (a finished output, an error, or, only for an aborted request, the
end of the iteration); each token is delivered once; a request that was neither aborted nor blamed gives exactly
what it gives run alone with plain decoding (greedy always; sampled too with speculation off), an aborted one a
prefix of it; only the poisoned request (or one hit by two faults in a row while it ran alone) finishes with an
error; once every stream ended the engine holds no request and no KV block, and the ids used are free again.

Deterministic by default (derandomized, no example database); set LOOPED_SPEC_HYPOTHESIS_EXAMPLES to
explore more examples locally.
"""

from __future__ import annotations

import asyncio
import gc
import os

from hypothesis import event, example, given, settings
from hypothesis import strategies as st
from server_utils import wait_until
from test_reliability_property import RANDOM_WORKLOADS, FaultyModel, alone, params_of, requests_st, scenario_engine

from looped_spec import AsyncLoopedSpecEngine
from looped_spec.engine.async_engine import EngineDeadError
from looped_spec.execution.sampler import SamplingRows

EXAMPLES = int(os.environ.get("LOOPED_SPEC_HYPOTHESIS_EXAMPLES", "20"))
FAMILY = "ouro"
#: the seed of a request whose every step fails (a fault of its own, not the model's)
POISON_SEED = 7_777_777
#: seconds a stream may take for its next output before the test calls it hung
PATIENCE = 20.0

#: (add, request, its id, what it is). The id: the front's own, one of two a client chooses (then often one used
#: before), or one that looks like the front's own. Its kind: most run as asked; "poisoned" fails every step it is in;
#: "invalid" has a prompt token outside the vocabulary (the engine refuses it when the worker admits it)
adds_st = st.tuples(
    st.just("add"),
    requests_st,
    st.sampled_from([None, None, "a", "b", "req-1"]),
    st.sampled_from(["plain"] * 6 + ["poisoned", "invalid"]),
)
actions_st = st.lists(
    st.one_of(
        adds_st,
        st.tuples(st.just("read"), st.integers(0, 20), st.integers(1, 3)),
        st.tuples(st.just("read"), st.integers(0, 20), st.just(None)),  # to its end
        st.tuples(st.just("leave"), st.integers(0, 20)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("abort"), st.integers(0, 20)),
        st.tuples(st.just("fault"), st.integers(0, 12)),
        st.tuples(st.just("wait"), st.sampled_from([0.0, 0.01, 0.05])),  # the worker goes on meanwhile
    ),
    min_size=3,
    max_size=18,
)
scenarios_st = st.fixed_dictionaries(
    {
        "speculation": st.sampled_from(["off", "2,1", "adaptive"]),
        "batching": st.sampled_from(["step", "loop"]),
        "num_kv_blocks": st.integers(8, 16),  # block_size 4, max_model_len 32: one request needs up to 8
        "prefix_caching": st.booleans(),
        "max_batch_size": st.integers(1, 4),
        "initial": st.lists(adds_st, min_size=1, max_size=4),
        "actions": actions_st,
        "shutdown_with_open_streams": st.booleans(),
    }
)


def request(prompt: list[int], max_tokens: int, **fields) -> dict:
    """A request as requests_st draws it: greedy, no stops, unless `fields` say otherwise."""
    spec = {"prompt": prompt, "max_tokens": max_tokens, "sampled": False, "seed": 0, "stop": [], "ignore_eos": True}
    return spec | {"logit_bias": {}, "penalties": {}, "min_tokens": 0, "undecodable_at": None, "priority": 0} | fields


def pinned(initial: list, actions: list, **options) -> dict:
    """A scenario as scenarios_st draws it: plain decoding, KV to spare, one request at a time, unless `options`
    say otherwise."""
    defaults = {"speculation": "off", "batching": "step", "num_kv_blocks": 16, "prefix_caching": False}
    return defaults | {"max_batch_size": 1, "shutdown_with_open_streams": False} | options | {
        "initial": initial, "actions": actions}  # fmt: skip


class Client:
    """One request as its client sees it: the outputs read, how its stream ended, whether it was aborted."""

    def __init__(self, request_id: str, spec: dict, what: str, stream) -> None:
        self.request_id, self.spec, self.what = request_id, spec, what
        self.poisoned = what == "poisoned"
        self.stream = stream
        self.outputs: list = []
        self.end: object = None  # "finished" | "stopped" (the iteration ended without one) | the exception raised
        self.aborted = False  # the client aborted it or left its stream
        self.iterator = None

    async def read(self, count: int | None) -> None:
        """The next `count` outputs (None: all), fewer when the stream ends."""
        if self.iterator is None:
            self.iterator = self.stream.__aiter__()
        while self.end is None and (count is None or count > 0):
            try:
                out = await asyncio.wait_for(self.iterator.__anext__(), PATIENCE)
            except StopAsyncIteration:
                self.end = "stopped"
                return
            except TimeoutError as exc:
                raise AssertionError(f"request {self.request_id}: its stream hung") from exc
            except Exception as exc:  # noqa: BLE001 - how the stream ended is what the test checks
                self.end = exc
                return
            self.outputs.append(out)
            if out.finished:
                self.end = "finished"
            count = None if count is None else count - 1

    async def leave(self) -> None:
        """The client goes away (`aclosing`): a stream it was reading is aborted."""
        if self.iterator is not None and self.end is None:
            self.aborted = True
            await self.iterator.aclose()
            self.end = "left"

    async def ended_once(self) -> None:
        """Nothing comes after the end."""
        if self.iterator is not None:
            try:
                await asyncio.wait_for(self.iterator.__anext__(), PATIENCE)
            except StopAsyncIteration:
                return
            raise AssertionError(f"request {self.request_id}: an output after its stream ended")


def poison_steps():
    """SamplingRows.build fails for any step that holds a request of POISON_SEED, every time: that request poisons
    its own steps. Returns the function that puts the original back."""
    original = SamplingRows.build.__func__

    def build(cls, requests, device, drafted=None):
        if any(r.seed == POISON_SEED for r in requests):
            raise RuntimeError("poisoned request")
        return original(cls, requests, device, drafted)

    SamplingRows.build = classmethod(build)
    return lambda: setattr(SamplingRows, "build", classmethod(original))


@settings(RANDOM_WORKLOADS, max_examples=EXAMPLES)
@given(scenarios_st)
# the front numbered its own ids without looking at those callers chose: a request without an id was refused
# ("request_id 'req-1' is already in use") while a caller's "req-1" ran
@example(pinned([("add", request([1, 2], 4), None, "plain"), ("add", request([3], 4), "req-1", "plain")],
                [("add", request([5, 6], 4), None, "plain")]))  # fmt: skip
# leaving a stream whose request had finished (its last output unread) aborted the newer request a caller gave its id
@example(pinned([("add", request([1, 2], 3), "a", "plain")],
                [("read", 0, 1), ("wait", 0.05), ("add", request([3], 3), "a", "plain"), ("leave", 0)]))  # fmt: skip
def test_random_client_actions_end_every_stream_once_with_plain_decodings_tokens(scenario):
    engine = scenario_engine(FAMILY, scenario, scenario["speculation"], batching=scenario["batching"])
    faulty = FaultyModel(engine.adapter, ("loop", "readout"))  # the adapter is shared: removed again in `finally`
    unpoison = poison_steps()
    front = AsyncLoopedSpecEngine(engine, max_queued=64)
    clients: list[Client] = []
    refused: list[str] = []

    async def run() -> None:
        for action in scenario["initial"] + scenario["actions"]:
            kind = action[0]
            if kind == "add":
                _, spec, request_id, what = action
                if what == "poisoned":
                    spec = spec | {"seed": POISON_SEED, "sampled": False}
                elif what == "invalid":
                    spec = spec | {"prompt": [*spec["prompt"], 10**6]}
                try:
                    stream = front.add_request(spec["prompt"], params_of(spec), request_id=request_id)
                except ValueError as exc:  # an id the client chose still in use, or being released after an abort
                    assert request_id is not None and "request_id" in str(exc), exc
                    refused.append(request_id)
                    continue
                clients.append(Client(stream.request_id, spec, what, stream))
            elif kind == "fault":
                if faulty.countdown is None:
                    faulty.arm(action[1])
            elif kind == "wait":
                await asyncio.sleep(action[1])
            elif clients:
                client = clients[action[1] % len(clients)]
                if kind == "read":
                    await client.read(action[2])
                elif kind == "leave":
                    await client.leave()
                elif kind == "abort":  # by id: that of the latest request under it (a client may reuse an id)
                    owner = [c for c in clients if c.request_id == client.request_id][-1]
                    owner.aborted = owner.aborted or owner.end is None  # after its end: nothing to abort
                    front.abort(client.request_id)
        if scenario["shutdown_with_open_streams"]:
            await asyncio.to_thread(front.shutdown)
        for client in clients:
            if client.end != "left":
                await client.read(None)
            await client.ended_once()

    front.start()
    try:
        asyncio.run(run())
        if not scenario["shutdown_with_open_streams"]:
            # every stream ended: the engine hands back what it still holds (aborted requests) and is then empty
            wait_until(lambda: not engine.has_unfinished_requests(), what="the engine idle")
            assert engine.request_ids() == [], "request ids leaked"
            assert engine.num_free_blocks == engine.kv.num_blocks, "KV blocks leaked"
            assert front.num_in_flight == 0

            async def reuse(request_id: str) -> list:  # an id used before is free again (once the worker saw it)
                probe = {"prompt": [7, 8, 9], "max_tokens": 2, "sampled": False, "seed": 0, "stop": [],
                         "ignore_eos": True}  # fmt: skip
                for _ in range(100):
                    try:
                        stream = front.add_request(probe["prompt"], params_of(probe), request_id)
                        break
                    except ValueError:  # aborted and still being released: the worker frees it after its step
                        await asyncio.sleep(0.05)
                else:
                    raise AssertionError(f"request_id {request_id!r} is never released")
                return [out async for out in stream]

            for request_id in ("a", "b"):
                assert asyncio.run(asyncio.wait_for(reuse(request_id), PATIENCE))[-1].finished
    finally:
        front.shutdown()
        faulty.remove()
        unpoison()
        gc.collect()  # engines hold their KV cache in reference cycles: free earlier examples' engines

    for client in clients:
        check_client(client, faulty.fired, scenario)
    event(f"faults fired: {min(faulty.fired, 2)}")
    event(f"refused ids: {bool(refused)}")
    event(f"aborted: {any(c.aborted for c in clients)}")
    event(f"poisoned: {any(c.poisoned for c in clients)}")
    event(f"batching: {scenario['batching']}")


def check_client(client: Client, faults: int, scenario: dict) -> None:
    name = f"request {client.request_id} ({client.what}: {client.spec})"
    outs = client.outputs
    assert all(not out.finished for out in outs[:-1]), f"{name}: an output after its finished one"
    tokens = [t for out in outs for t in out.new_token_ids]
    if outs:
        assert tokens == outs[-1].token_ids, f"{name}: tokens delivered other than once each"
        assert all(out.request_id == client.request_id for out in outs)
    if isinstance(client.end, EngineDeadError):  # the front shut down while it was open
        assert scenario["shutdown_with_open_streams"], f"{name}: {client.end!r}"
        assert "shut down" in str(client.end), client.end
    elif client.end in ("stopped", "left"):  # the iteration ended without a finished output: aborted only
        assert client.aborted, f"{name}: its stream ended without an output ({client.end})"
    elif client.what == "invalid":  # refused when the worker admitted it: its stream says why, naming the prompt
        assert isinstance(client.end, ValueError) and "prompt" in str(client.end), f"{name}: {client.end!r}"
        return
    elif isinstance(client.end, BaseException):
        raise AssertionError(f"{name}: its stream ended with {client.end!r}")
    else:
        assert client.end == "finished", f"{name}: its stream did not end ({client.end})"
        final = outs[-1]
        assert final.finish_reason != "abort", f"{name}: an aborted stream's output was delivered"
        if final.finish_reason == "error":
            # its own fault, or two faults in a row while it ran alone (the engine's rule then blames it)
            assert client.poisoned or (faults >= 2 and "injected fault" in final.error), f"{name}: {final.error}"
            # (a one-shot fault may strike one of its steps alone: the error is then the fault's)
            assert not client.poisoned or "poisoned request" in final.error or "injected fault" in final.error
            return
        assert not client.poisoned, f"{name}: finished {final.finish_reason} though its every step fails"
    if client.what != "plain" or (client.spec["sampled"] and scenario["speculation"] != "off"):
        return  # no tokens to compare: none, or the same distribution and not the same draws
    expected = list(alone(FAMILY, tuple(client.spec["prompt"]), params_of(client.spec).model_dump_json()))
    if client.end == "finished":
        assert tokens == expected, f"{name}: {tokens} != plain decoding's {expected}"
    else:
        assert tokens == expected[: len(tokens)], f"{name}: {tokens} is not a prefix of {expected}"
