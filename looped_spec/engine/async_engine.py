"""AsyncLoopedSpecEngine: one engine, its step loop in one background thread, async streams in front.

Request handlers run on an asyncio event loop; the engine's `step()` blocks for a whole round, so it
runs in a worker thread. The two sides talk only through a thread-safe command queue (add / abort,
drained by the worker between steps) and per-request asyncio queues that the worker fills with
`loop.call_soon_threadsafe`. The engine is touched by the worker thread alone.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Iterable
from dataclasses import dataclass
from typing import Any

from looped_spec.engine.engine import LoopedSpecEngine
from looped_spec.engine.inputs import Prompt
from looped_spec.request import RequestOutput
from looped_spec.sampling_params import SamplingParams, sampling_params_argument

logger = logging.getLogger(__name__)


class QueueFullError(RuntimeError):
    """Admission is bounded: running + queued requests would exceed the limit."""


class EngineDeadError(RuntimeError):
    """The worker thread is not running (stopped, or never started)."""


class EngineFaultError(RuntimeError):
    """The engine failed while running this request; the request was ended."""


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue  # RequestOutput | BaseException


#: put into a stream's queue by `abort()`: the iteration ends there, without a further output
_ABORTED = object()


class RequestStream:
    """The outputs of one request, in order, ending with a finished one.

    Leaving the iteration early (the client went away, the task was cancelled) aborts the request,
    so its KV blocks are freed; so does `abort()`. An engine fault ends it with EngineFaultError.
    """

    def __init__(self, owner: AsyncLoopedSpecEngine, request_id: str, outputs: asyncio.Queue) -> None:
        self.owner = owner
        self.request_id = request_id
        self._outputs = outputs
        self.finished = False

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        try:
            while not self.finished:
                item = await self._outputs.get()
                if item is _ABORTED:  # aborted while (or before) it was read: nothing more comes
                    self.finished = True
                    return
                if isinstance(item, BaseException):
                    self.finished = True
                    raise item
                self.finished = item.finished
                yield item
        finally:
            if not self.finished:
                self.abort()

    def abort(self) -> None:
        self.finished = True
        self.owner._abort_stream(self.request_id, self._outputs)


#: the error of a call before start() (or after shutdown()), with the way to start it
NOT_RUNNING = (
    "the engine is not running: start() it, or use `with AsyncLoopedSpecEngine(engine) as front:` (after "
    "shutdown(), a new one)"
)


class AsyncLoopedSpecEngine:
    """Async front of a `LoopedSpecEngine`: `generate()` yields a request's outputs as they come.

    `max_queued` bounds admission: at most `engine.max_batch_size + max_queued` requests are in the
    engine at once; beyond that `generate()` raises `QueueFullError` (HTTP 429) before queuing anything.
    """

    def __init__(self, engine: LoopedSpecEngine, max_queued: int = 256) -> None:
        if not isinstance(engine, LoopedSpecEngine):
            raise TypeError(f"engine: a LoopedSpecEngine, got {type(engine).__name__} (AsyncLoopedSpecEngine("
                            "LoopedSpecEngine(model, ...)) wraps one)")  # fmt: skip
        if max_queued < 0:
            raise ValueError(f"max_queued={max_queued} must be >= 0")
        self.engine = engine
        self.max_in_flight = engine.max_batch_size + max_queued
        self._streams: dict[str, _Stream] = {}
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._ids = itertools.count()
        self._lock = threading.Lock()  # guards _streams between the event loop and the worker
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._scores: set[asyncio.Future] = set()  # scores waiting or running (each holds an in-flight place)
        self._closing: str | None = None  # set by end_all and shutdown: why no more work is admitted
        # aborted ids the engine may still hold (until a step hands them back): not reusable before that, or a new
        # stream of the same id would get the old request's outputs
        self._retiring: set[str] = set()

    # ----- lifecycle -----
    def start(self) -> None:
        if self._thread is not None:
            return
        if self.engine.closed:
            raise EngineDeadError("the engine was shut down (its KV cache and weights are released): make a new one")
        self._stop.clear()
        self._closing = None
        self._thread = threading.Thread(target=self._run, name="looped-spec-engine", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        """Stop the worker (after its current step), end every open stream and close the engine (its KV cache and,
        when it loaded them, its weights are released)."""
        reason = "the engine was shut down"
        with self._lock:  # first admit nothing more: a request or score racing this call is refused, or ended below
            self._closing = self._closing or reason  # end_all's reason, when it ran, stays the one given
        self._stop.set()
        self._commands.put(("wake", None))
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        self._fail_all(EngineDeadError(reason))
        with self._lock:  # scores admitted but not answered (their command may come after the worker's last look)
            scores = list(self._scores)
        for future in scores:
            _post(future.get_loop(), _settle, future, EngineDeadError(reason))
        self.engine.close()

    def __enter__(self) -> AsyncLoopedSpecEngine:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    @property
    def is_running(self) -> bool:
        thread = self._thread  # read once: shutdown() on another thread sets it to None
        return thread is not None and thread.is_alive()

    @property
    def errored(self) -> bool:
        """Whether it takes no more work (not started, shut down, its worker dead, or `end_all` ran): vLLM's
        `errored`."""
        return self._closing is not None or not self.is_running

    @property
    def is_stopped(self) -> bool:
        """vLLM's `is_stopped`: `errored`."""
        return self.errored

    @property
    def dead_error(self) -> EngineDeadError:
        """The error a request gets while `errored`, saying why (vLLM's `dead_error`)."""
        return EngineDeadError(self._closing or NOT_RUNNING)

    async def check_health(self) -> None:
        """vLLM's `check_health()`: raises `dead_error` while `errored`, else returns."""
        if self.errored:
            raise self.dead_error

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (None for a model without one), as vLLM's `get_tokenizer()`: loaded with the engine
        and never changed, so it is read here beside the worker."""
        return self.engine.get_tokenizer()

    @property
    def tokenizer(self) -> Any:
        """vLLM's `tokenizer`: `get_tokenizer()`."""
        return self.engine.get_tokenizer()

    @property
    def num_in_flight(self) -> int:
        """Requests and admitted scores in the engine (running, queued, or waiting for the worker)."""
        return len(self._streams) + len(self._scores)

    # ----- requests -----
    def add_request(
        self, prompt: Prompt, params: SamplingParams, request_id: str | None = None, priority: int = 0
    ) -> RequestStream:
        """Queue a request now (or raise QueueFullError / EngineDeadError, or the engine's error for a `priority` it
        does not schedule by); iterate the stream for outputs. `prompt` as `LoopedSpecEngine.add_request` takes it
        (vLLM's prompt dicts, with a `cache_salt`, included); the engine's error for a prompt it refuses comes from
        the stream, as does EngineFaultError for a fault in model code while it is admitted (`prompt_logprobs` are
        computed then)."""
        self._check_running()
        self.engine.check_priority(priority)  # reads the engine's config only: safe beside the worker
        try:  # outputs are posted to the caller's event loop
            loop = asyncio.get_running_loop()
        except RuntimeError:
            raise RuntimeError(
                "AsyncLoopedSpecEngine.add_request: call it from a coroutine (inside a running asyncio event loop); "
                "outside one, use LoopedSpecEngine's generate() or add_request() and step()"
            ) from None
        stream = _Stream(loop, asyncio.Queue())
        with self._lock:
            self._check_room()
            if request_id is None:  # the next number no live request uses (a caller may have chosen "req-3" itself)
                request_id = f"req-{next(self._ids)}"
                while request_id in self._streams or request_id in self._retiring:
                    request_id = f"req-{next(self._ids)}"
            request_id = str(request_id)  # the engine's ids are str
            if request_id in self._streams:
                raise ValueError(f"request_id {request_id!r} is already in use")
            if request_id in self._retiring:
                raise ValueError(f"request_id {request_id!r} was just aborted and is still being released; retry")
            self._streams[request_id] = stream
        self._commands.put(("add", (request_id, prompt, params, priority)))
        return RequestStream(self, request_id, stream.queue)

    async def generate(
        self, prompt: Prompt, sampling_params: SamplingParams | None = None, request_id: str | None = None,
        priority: int = 0, *, params: SamplingParams | None = None, lora_request: None = None,
    ) -> AsyncIterator[RequestOutput]:  # fmt: skip
        """`add_request` and iterate its outputs until it finishes (`sampling_params` as vLLM's `AsyncLLM.generate`
        names it; `params=`: its older name). `lora_request=None` is vLLM's default; a LoRA is refused, naming it."""
        params = sampling_params_argument(sampling_params, params)
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported (serve a checkpoint with the adapter "
                             "merged into its weights)")  # fmt: skip
        async for output in self.add_request(prompt, params, request_id, priority):
            yield output

    def _check_running(self) -> None:
        """EngineDeadError unless the worker runs: why it ended (`end_all`'s reason: a worker that died of a
        BaseException cannot be started again, so "start() it" would mislead), else how to start it."""
        if self._closing is not None:
            raise EngineDeadError(self._closing)
        if not self.is_running:
            raise EngineDeadError(NOT_RUNNING)

    def _check_room(self) -> None:
        """EngineDeadError once `end_all` ran; QueueFullError when the in-flight requests and scores are at the limit
        (the caller holds the lock)."""
        if self._closing is not None:
            raise EngineDeadError(self._closing)
        if len(self._streams) + len(self._scores) >= self.max_in_flight:
            raise QueueFullError(
                f"{len(self._streams)} requests and {len(self._scores)} scores in flight (limit {self.max_in_flight})"
            )

    async def score(self, token_ids: list[int], top_n: int = 0, seed: int = 0) -> list:
        """`LoopedSpecEngine.score`, run by the worker between two steps (the engine is the worker's). A score is a
        forward over the whole sequence, so it holds a place among the in-flight requests while it waits and runs
        (QueueFullError when none is left); one whose caller went away (cancelled) before the worker reached it is
        skipped. The caller's argument errors (ValueError / TypeError) come from here, before it is queued; what the
        worker's forward raises is a fault in the model (EngineFaultError), whatever its type."""
        self._check_running()
        self.engine.check_score(token_ids, top_n, seed)  # reads the engine's config only: safe beside the worker
        future = asyncio.get_running_loop().create_future()
        with self._lock:
            self._check_room()
            self._scores.add(future)
        try:
            self._commands.put(("score", (token_ids, top_n, seed, future)))
            return await future
        finally:
            with self._lock:
                self._scores.discard(future)

    def abort(self, request_id: str | Iterable[str]) -> _Done:
        """Abort a request, or each of several (as vLLM's `abort` takes them; no-op for one that finished); its stream
        ends without a further output (a reader waiting on it stops there). Done when it returns; what it returns may
        be awaited, as vLLM's coroutine is (`await engine.abort(request_id)`)."""
        if not isinstance(request_id, str) and isinstance(request_id, Iterable):
            for one in list(request_id):
                self._abort_stream(str(one))
        else:
            self._abort_stream(str(request_id))
        return _DONE

    def _abort_stream(self, request_id: str, outputs: asyncio.Queue | None = None) -> None:
        """Abort `request_id`; with `outputs`, only while it is still the request of the stream reading `outputs`: a
        stream whose request finished (its last output unread) and that a client then leaves must not abort a newer
        request a caller gave the same id."""
        with self._lock:
            stream = self._streams.get(request_id)
            if stream is None or (outputs is not None and stream.queue is not outputs):
                return
            del self._streams[request_id]
            self._retiring.add(request_id)
        _post(stream.loop, stream.queue.put_nowait, _ABORTED)
        self._commands.put(("abort", request_id))

    def end_all(self, reason: str) -> None:
        """A server shutting down: admit nothing more, end every open stream and every waiting score with
        EngineDeadError(`reason`), and abort the streams' requests."""
        with self._lock:
            self._closing = reason
            ids, scores = list(self._streams), list(self._scores)
            self._retiring.update(ids)
        self._fail_all(EngineDeadError(reason), ids)
        for request_id in ids:
            self._commands.put(("abort", request_id))
        for future in scores:
            _post(future.get_loop(), _settle, future, EngineDeadError(reason))

    # ----- the worker thread -----
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:
            # what no handler below catches (SystemExit, KeyboardInterrupt, another BaseException out of model code)
            # ends the worker: every open stream and waiting score ends with it instead of waiting for it for good,
            # and nothing more is admitted
            self.end_all(f"the engine's worker stopped: {type(exc).__name__}: {exc}")
            raise

    def _serve(self) -> None:
        engine = self.engine
        failures = 0  # steps failed in a row
        while not self._stop.is_set():
            # block for work when idle; otherwise take what arrived during the last step
            block = not engine.has_unfinished_requests()
            try:
                self._apply(self._commands.get(timeout=1.0) if block else self._commands.get_nowait())
                while True:
                    self._apply(self._commands.get_nowait())
            except queue.Empty:
                pass
            # (an abort applied leaves its request's output pending: the engine has it unfinished until a step)
            if self._stop.is_set() or not engine.has_unfinished_requests():
                continue
            try:
                outputs = engine.step()
            except Exception as exc:  # one bad step must not take the server down
                # the engine's own rule (docs/architecture.md, "Failure semantics"): the step left every request as
                # it was; its requests run alone next, and one that fails alone twice is finished with an error
                # output (its stream ends with an error event). Only failures outside that rule — more in a row
                # than it can take to blame every request — end every stream.
                failures += 1
                limit = engine.FAILURES_TO_BLAME * (len(engine.request_ids()) + 1)
                if failures > limit:
                    logger.exception("engine step failed %d times in a row; ending every request", failures)
                    self._recover(exc)
                    failures = 0
                else:
                    logger.warning("engine step failed (%d in a row); retrying by the engine's rule: %r", failures, exc)
                continue
            failures = 0
            for out in outputs:
                if out.request_id in self._retiring:  # an aborted request handed back: its id is free again
                    if out.finished:
                        with self._lock:
                            self._retiring.discard(out.request_id)
                    continue
                self._deliver(out.request_id, out, out.finished)

    def _apply(self, command: tuple) -> None:
        kind, payload = command
        if kind == "add":
            request_id, prompt, params, priority = payload
            if request_id not in self._streams:  # aborted before the worker saw it: the engine never held it
                with self._lock:
                    self._retiring.discard(request_id)
                return
            try:
                self.engine.add_request(prompt, params, request_id=request_id, priority=priority)
            except (ValueError, TypeError) as exc:  # refused: that request's error, not the worker's
                self._deliver(request_id, exc, True)
            except Exception as exc:  # the model's (prompt_logprobs' forward runs at admission): a fault, as a step's
                self._deliver(request_id, engine_fault(exc), True)
        elif kind == "score":
            token_ids, top_n, seed, future = payload
            if future.done():  # its caller went away before the worker got to it
                return
            try:
                result: object = self.engine.score(token_ids, top_n, seed)
            except Exception as exc:  # the model's (score() checked the arguments): a fault, as a step's
                result = engine_fault(exc)
            loop = future.get_loop()
            _post(loop, _settle, future, result)
        elif kind == "abort":
            try:
                self.engine.abort(payload)
            except KeyError:  # finished (or never added) before the abort arrived: the engine holds nothing of it
                with self._lock:
                    self._retiring.discard(payload)

    def _deliver(self, request_id: str, item: RequestOutput | BaseException, last: bool) -> None:
        with self._lock:
            stream = self._streams.pop(request_id, None) if last else self._streams.get(request_id)
        if stream is not None:
            _post(stream.loop, stream.queue.put_nowait, item)

    def _recover(self, exc: Exception) -> None:
        """Steps keep failing beyond the engine's rule: end every request it holds, free their KV, keep the worker
        alive."""
        engine = self.engine
        affected = engine.request_ids()
        for request_id in affected:
            try:
                engine.abort(request_id)
            except KeyError:
                pass
        try:
            engine.step()  # hands back the aborted requests (schedules nothing: none is left)
            with self._lock:  # the engine holds none of them now: aborted ids among them are free again
                self._retiring.difference_update(affected)
        except Exception:  # already failing: keep the worker alive
            logger.exception("engine could not flush aborted requests")
            # the engine still holds them (a later step hands them back): their ids are not free before that, or a
            # new request of the same id would be refused by the engine or get the old one's output
            with self._lock:
                self._retiring.update(affected)
        self._fail_all(engine_fault(exc), affected)

    def _fail_all(self, exc: BaseException, request_ids: list[str] | None = None) -> None:
        with self._lock:
            ids = list(self._streams) if request_ids is None else [i for i in request_ids if i in self._streams]
            streams = [self._streams.pop(i) for i in ids]
        for stream in streams:
            _post(stream.loop, stream.queue.put_nowait, exc)


def engine_fault(exc: Exception) -> EngineFaultError:
    """What a caller gets for a fault in the engine's own code (model code, not the caller's request)."""
    return EngineFaultError(f"engine error: {type(exc).__name__}: {exc}")


class _Done:
    """What `abort` returns: awaiting it gives None at once (the abort is already done), so vLLM's `await
    engine.abort(request_id)` runs unchanged, and a call without await loses nothing."""

    __slots__ = ()

    def __await__(self):
        return iter(())


_DONE = _Done()


def _post(loop: asyncio.AbstractEventLoop, callback, *args) -> None:
    """`callback(*args)` on the caller's event loop; nothing when that loop is closed (its caller is gone, and the
    worker must not die of it: other callers' work goes on)."""
    try:
        loop.call_soon_threadsafe(callback, *args)
    except RuntimeError:
        if not loop.is_closed():
            raise


def _settle(future: asyncio.Future, result: object) -> None:
    if future.done():  # the caller went away
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)
