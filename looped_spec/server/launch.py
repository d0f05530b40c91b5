"""Run the server with uvicorn (what `looped-spec serve` calls)."""

from __future__ import annotations

import asyncio
import socket

import uvicorn

from looped_spec.engine.async_engine import AsyncLoopedSpecEngine
from looped_spec.engine.engine import LoopedSpecEngine
from looped_spec.server.app import build_app
from looped_spec.server.chat_template import ChatTemplateConfig
from looped_spec.server.tools import ToolCallingConfig


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
    tool_calling: ToolCallingConfig | None = None,
    chat_template: ChatTemplateConfig | None = None,
    reasoning_parser: str | None = None,
    return_tokens_as_token_ids: bool = False,
) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM); the engine's worker stops with the server."""
    front = AsyncLoopedSpecEngine(engine, max_queued=max_queued)
    app = build_app(front, model_name, api_key, max_body_bytes, tool_calling=tool_calling, chat_template=chat_template,
                    reasoning_parser=reasoning_parser,
                    return_tokens_as_token_ids=return_tokens_as_token_ids)  # fmt: skip
    # on shutdown, open requests get a few seconds to finish; then they end with an error, and the engine stops
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    server = DrainingServer(config, front)
    server.run(sockets=[sock] if sock is not None else None)


class DrainingServer(uvicorn.Server):
    """uvicorn's server, whose shutdown ends the requests still open a second before its graceful timeout with an
    error (a stream's last events say the server is shutting down, then [DONE]; an answer not streamed is a 503)
    instead of letting uvicorn cut their connections mid-response."""

    def __init__(self, config: uvicorn.Config, front: AsyncLoopedSpecEngine) -> None:
        super().__init__(config)
        self.front = front

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        grace = self.config.timeout_graceful_shutdown
        if grace is None:  # uvicorn waits for open requests as long as they take
            return await super().shutdown(sockets)
        end = asyncio.get_running_loop().call_later(max(grace - 1.0, 0.0), self.front.end_all, "the server is "
                                                    "shutting down")  # fmt: skip
        try:
            await super().shutdown(sockets)
        finally:
            end.cancel()
