"""Anthropic's error shape for the /v1/messages routes: `{"type": "error", "error": {"type", "message"}}`.

Every refusal on this server is made once, OpenAI-shaped (the app's exception handlers, the API key and body
size guards); AnthropicErrorsMiddleware reshapes those answers on the Messages routes only, so each rule keeps
one source and the OpenAI routes keep their shape. Statuses are Anthropic's: the same codes, but an engine
that cannot take requests now (503: draining, asleep, dead) is Anthropic's 529 overloaded_error.
"""
from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from pagedserve.frontend.http.guards import Message, Receive, Scope, Send, route_path

ROUTE_PREFIX = "/v1/messages"
# HTTP status -> (Anthropic's status, its error type).
_BY_STATUS = {400: (400, "invalid_request_error"), 401: (401, "authentication_error"),
              403: (403, "permission_error"), 404: (404, "not_found_error"), 405: (405, "invalid_request_error"),
              413: (413, "request_too_large"), 429: (429, "rate_limit_error"), 503: (529, "overloaded_error")}
_DEFAULT = (500, "api_error")


def anthropic_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    """(Anthropic's status, its error body) for a refusal with this HTTP status."""
    code, kind = _BY_STATUS.get(status, (status, "invalid_request_error") if status < 500 else _DEFAULT)
    return code, {"type": "error", "error": {"type": kind, "message": message}}


def stream_error(payload: dict[str, Any]) -> dict[str, Any]:
    """An OpenAI-shaped error body (frontend/openai/serving.py's error_body) as a stream's error event."""
    error = payload["error"]
    return anthropic_error(error.get("code") or 500, error["message"])[1]


def _reshape(status: int, body: bytes) -> tuple[int, bytes]:
    try:
        error = json.loads(body)["error"]
        message = error["message"] if isinstance(error, dict) else str(error)
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace") or "error"
    code, payload = anthropic_error(status, message)
    return code, json.dumps(payload, ensure_ascii=False).encode()


class AnthropicErrorsMiddleware:
    """On the Messages routes, every error answer (status 400 and above) in Anthropic's shape."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not route_path(scope).startswith(ROUTE_PREFIX):
            await self.app(scope, receive, send)
            return
        start: dict[str, Any] = {}
        chunks: list[bytes] = []

        async def reshaping_send(message: Message) -> None:
            if message["type"] == "http.response.start" and message["status"] >= 400:
                start.update(message)           # held until the whole (small) error body is in
                return
            if not start or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            status, body = _reshape(start["status"], b"".join(chunks))
            headers = [(k, v) for k, v in start.get("headers", []) if k.lower() not in (b"content-length",
                                                                                         b"content-type")]
            headers += [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
            await send({**start, "status": status, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, reshaping_send)
