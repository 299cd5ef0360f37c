"""The caller's W3C trace context (`traceparent`, `tracestate`), kept for the request being handled.

An ASGI middleware puts the headers in a context variable; the engine client reads it when the request
starts, in the same context (a streamed body runs in a task that copies the handler's context)."""
from __future__ import annotations

import contextvars
from typing import Any, Awaitable, Callable

TRACE_HEADERS = (b"traceparent", b"tracestate")

_headers: contextvars.ContextVar[dict[str, str]] = contextvars.ContextVar("trace_headers", default={})

Scope = dict[str, Any]
App = Callable[[Scope, Callable, Callable], Awaitable[None]]


def current_trace_headers() -> dict[str, str]:
    """The trace headers of the HTTP request this code runs for ({} outside one, or when it sent none)."""
    return _headers.get()


class TraceHeadersMiddleware:
    def __init__(self, app: App) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        found = {name.decode(): value.decode("latin-1") for name, value in scope.get("headers", ())
                 if name in TRACE_HEADERS}
        token = _headers.set(found)
        try:
            await self.app(scope, receive, send)
        finally:
            _headers.reset(token)
