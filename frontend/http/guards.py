"""ASGI middleware guarding every request before routing: the API key (401), the body size (413).

Plain ASGI rather than Starlette's BaseHTTPMiddleware: that one hides the client's disconnect from the
endpoint, so an abandoned non-streaming request would keep generating.
"""
from __future__ import annotations

import hmac
import json
from typing import Any, Awaitable, Callable

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimitMiddleware:
    """Reads the body before the app does, counting bytes, then replays it; a body that declares or reaches
    more than `max_bytes` is answered 413 without reading the rest."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope.get("headers", ())).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            await self._too_large(send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":      # the client went away before sending it all
                return
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_bytes:
                await self._too_large(send)
                return
            if not message.get("more_body", False):
                break
        await self.app(scope, _replay(b"".join(chunks), receive), send)

    async def _too_large(self, send: Send) -> None:
        await send_error(send, 413, f"request body exceeds {self.max_bytes} bytes", "invalid_request_error",
                         close=True)


class ApiKeyMiddleware:
    """Every path but `open_paths` needs `Authorization: Bearer KEY` or, as Anthropic's clients send it,
    `x-api-key: KEY`: deny by default, so a route added later is protected without anyone remembering to."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]], api_key: str,
                 open_paths: frozenset[str]) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()
        self.expected_key = api_key.encode()
        self.open_paths = open_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and route_path(scope) not in self.open_paths:
            headers = dict(scope.get("headers", ()))
            bearer = hmac.compare_digest(headers.get(b"authorization", b""), self.expected)
            if not (bearer or hmac.compare_digest(headers.get(b"x-api-key", b""), self.expected_key)):
                await send_error(send, 401, "invalid or missing API key", "authentication_error")
                return
        await self.app(scope, receive, send)


def route_path(scope: Scope) -> str:
    """The path the routes see: without the --root-path prefix, whether the client sent it (direct) or a
    proxy already stripped it."""
    path, root = scope["path"], scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):] or "/"
    return path


async def send_error(send: Send, status: int, message: str, kind: str, close: bool = False) -> None:
    """An OpenAI-shaped JSON error, answered before the app sees the request."""
    body = json.dumps({"error": {"message": message, "type": kind, "param": None, "code": status}}).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    if close:       # the unread rest of the body must not be taken for the next request
        headers.append((b"connection", b"close"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def _replay(body: bytes, receive: Receive) -> Receive:
    """The buffered body once, then the real channel (disconnect notices while a response streams)."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()
    return replayed
