"""Run the server with uvicorn (what `looped-spec serve` calls)."""

from __future__ import annotations

import socket

import uvicorn

from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
from looped_spec.engine.engine import LoopedSpecEngine
from looped_spec.server.app import build_app


def serve(
    engine: LoopedSpecEngine,
    model_name: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    max_queued: int = 256,
    max_body_bytes: int = 1 << 20,
    log_level: str = "info",
    sock: socket.socket | None = None,
) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM); the engine's worker stops with the server."""
    app = build_app(AsyncLoopedSpecEngine(engine, max_queued=max_queued), model_name, api_key, max_body_bytes)
    # on shutdown, open streams get a few seconds to finish; then the engine worker stops
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    server.run(sockets=[sock] if sock is not None else None)
