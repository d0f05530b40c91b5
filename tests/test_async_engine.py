"""AsyncLoopedSpecEngine without HTTP: streams equal offline generation, leaving a stream aborts it."""

from __future__ import annotations

import asyncio
from contextlib import aclosing

import pytest
from conftest import make_engine
from server_utils import wait_until

from looped_spec import AsyncLoopedSpecEngine, SamplingParams
from looped_spec.engine.async_engine import QueueFullError

PROMPTS = [[1, 5, 9, 2], [3, 3, 7], [8, 1, 4, 4, 6]]


def test_concurrent_streams_equal_offline_generate_and_abort_frees_kv():
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    expected = [o.token_ids for o in make_engine("ouro").generate(PROMPTS, params)]
    engine = make_engine("ouro", speculation="2,1", max_batch_size=4)
    front = AsyncLoopedSpecEngine(engine, max_queued=0)

    async def collect(prompt) -> list[int]:
        tokens = []
        async for out in front.generate(prompt, params):
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
    finally:
        front.shutdown()
