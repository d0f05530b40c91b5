"""ASGI middleware: bearer-token auth for /v1/*, a bound on request body size, the replica's name on responses."""

from __future__ import annotations

import json
import secrets

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from looped_spec.server.errors import error_body


async def _send_error(send: Send, status: int, message: str, headers: list | None = None) -> None:
    body = json.dumps(error_body(status, message)).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(body)).encode()), *(headers or [])]})  # fmt: skip
    await send({"type": "http.response.body", "body": body})


class APIKeyMiddleware:
    """Every /v1/* request must carry `Authorization: Bearer KEY` (/health and /metrics stay open)."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            scheme, _, key = dict(scope["headers"]).get(b"authorization", b"").partition(b" ")
            # the scheme is case-insensitive (RFC 9110); the key is compared in constant time
            if scheme.lower() != b"bearer" or not secrets.compare_digest(key.strip(), self.expected):
                await _send_error(send, 401, "missing or wrong API key (Authorization: Bearer KEY)",
                                  [(b"www-authenticate", b"Bearer")])  # fmt: skip
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Refuse request bodies over `max_bytes` with 413, by Content-Length or while reading a chunked body."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        # the limit is the operator's (a harness batching long prompts meets it): name the setting that raises it
        too_large = f"request body over {self.max_bytes} bytes (the server's --max-body-bytes)"
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_bytes:
            await _send_error(send, 413, too_large)
            return
        # read the whole (bounded) body first, then replay it to the app
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                break
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await _send_error(send, 413, too_large)
                return
            more = message.get("more_body", False)
        body = b"".join(chunks)
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()  # later calls wait for http.disconnect, as usual

        await self.app(scope, replay, send)


class ReplicaHeaderMiddleware:
    """Name the replica that answered in an `x-looped-spec-replica` response header (behind a router of replicas)."""

    def __init__(self, app: ASGIApp, replica: str) -> None:
        self.app = app
        self.header = (b"x-looped-spec-replica", replica.encode())

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), self.header]}
            await send(message)

        await self.app(scope, receive, send_named)
