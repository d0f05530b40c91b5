"""A real looped-spec server on 127.0.0.1 (an ephemeral port) in a background thread, for tests."""

from __future__ import annotations

import os
import socket
import threading
import time

import uvicorn

from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
from looped_spec.server import build_app
from looped_spec.server.launch import DrainingServer


class ServerThread:
    """Starts uvicorn on a socket bound to 127.0.0.1:0; `url` is its base URL. Use as a context manager."""

    def __init__(self, engine, model_name: str, max_queued: int = 64, graceful_seconds: float | None = None,
                 **app_options) -> None:  # fmt: skip
        self.engine = engine
        self.async_engine = AsyncLoopedSpecEngine(engine, max_queued=max_queued)
        self.app = build_app(self.async_engine, model_name, **app_options)
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(self.app, log_level="warning", timeout_graceful_shutdown=graceful_seconds)
        self.server = DrainingServer(config, self.async_engine)  # as `looped-spec serve` runs it
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + 120
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the test server did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.sock.close()

    def client(self, api_key: str = "unused"):
        """The official openai client on this server (no retries: a test sees the first answer)."""
        import openai

        return openai.OpenAI(base_url=self.url + "/v1", api_key=api_key, max_retries=0, timeout=60)


def wait_until(condition, timeout: float = 30.0, what: str = "condition") -> None:
    """Poll `condition()` until true (the engine's worker runs in another thread)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def ray_subprocess_env() -> dict[str, str]:
    """The environment of a subprocess that starts its own local Ray cluster under the test suite: no RAY_ADDRESS
    (never a cluster of the machine's), one torch thread per replica, and Ray's proxy given a minute for its ready and
    health checks (5 and 10 s by default: on a 2-core box running the suite's other workers a check can miss them
    three times, and Ray then restarts the proxy mid-test)."""
    timeouts = dict.fromkeys(("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"), "60")
    return {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"OMP_NUM_THREADS": "1"} | timeouts


def idle(server) -> bool:
    """Nothing in flight on a `ServerThread`'s engine and every KV block free."""
    engine = server.engine
    return (
        server.async_engine.num_in_flight == 0
        and not engine.has_unfinished_requests()
        and engine.num_free_blocks == engine.kv.num_blocks
    )


def offline_reference(model: str):
    """A module fixture's body (`yield from`): the offline engine a server test checks answers against, plain
    decoding, closed after the module."""
    from looped_spec import LoopedSpecEngine

    engine = LoopedSpecEngine(model, speculation="off", max_model_len=256)
    yield engine
    engine.close()


def hermes_tool_server(model: str, max_batch_size: int):
    """A module fixture's body (`yield from`): a server of `model` under adaptive speculation whose tool calls are
    parsed as Hermes writes them (auto tool choice), stopped after the module."""
    from looped_spec import LoopedSpecEngine
    from looped_spec.server.tools import ToolCallingConfig

    engine = LoopedSpecEngine(model, speculation="adaptive", max_batch_size=max_batch_size, max_model_len=256)
    tools = ToolCallingConfig(enable_auto_tool_choice=True, tool_call_parser="hermes")
    with ServerThread(engine, model, tool_calling=tools) as running:
        yield running


def greedy(engine, prompt, max_tokens: int, **params):
    """The offline engine's greedy output of `prompt` (what a server test compares an answer with)."""
    from looped_spec import SamplingParams

    return engine.generate(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, **params))[0]
