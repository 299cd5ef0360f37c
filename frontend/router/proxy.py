"""Forwarding one request: pick a replica, send, retry elsewhere on a failure before the first byte, then
stream the replica's bytes through.

Before the first byte (connection refused or reset, a timeout, 503 while draining, 429 while full) nothing
has reached the client, so another replica may take the request, up to --max-retries others. After it, the
bytes pass through as they come: an SSE stream event by event (an event is never cut in two), so a stream that
breaks mid-way can end with one error event and `[DONE]`, and the client never waits on a dead socket.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import httpx
from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.frontend.router.lora import LoraPlacer
from pagedserve.frontend.router.metrics import RouterMetrics
from pagedserve.frontend.router.pool import Replica, ReplicaPool
from pagedserve.frontend.router.routing import RequestFacts, Routing

logger = logging.getLogger(__name__)

# Not forwarded either way: hop-by-hop headers, and what the router sets itself.
_DROP_REQUEST = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                           "upgrade", "te", "proxy-authorization"})
_DROP_RESPONSE = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})
DEFAULT_RETRY_AFTER_S = 1


@dataclass
class Proxy:
    pool: ReplicaPool
    routing: Routing
    metrics: RouterMetrics
    client: httpx.AsyncClient
    max_retries: int
    pass_client_auth: bool      # no router key and no replica key: the client's key is for the replicas
    lora: LoraPlacer | None = None      # routing-logic lora: loads an adapter where none has it

    async def forward(self, request: Request, body: bytes, facts: RequestFacts) -> Response:
        tried: set[int] = set()
        refusals: list[httpx.Response] = []
        for _ in range(1 + self.max_retries):
            candidates = [r for r in self.pool.candidates(facts.model) if r.index not in tried]
            if not candidates and self.lora is not None:
                placed = await self.lora.place(facts.model, tried)
                candidates = [placed] if placed is not None else []
                if placed is not None:
                    self.metrics.decisions.labels(self.routing.logic, "lora-load").inc()
            if not candidates:
                break
            replica, decision = self.routing.pick(candidates, facts)
            self.metrics.decisions.labels(self.routing.logic, decision).inc()
            tried.add(replica.index)
            upstream = await self._send(replica, request, body)
            if isinstance(upstream, httpx.Response) and upstream.status_code not in (429, 503):
                return self._relay(replica, upstream)
            self.routing.done(replica)
            if isinstance(upstream, httpx.Response):
                await upstream.aclose()
                refusals.append(upstream)
                reason = str(upstream.status_code)
                if upstream.status_code == 503:     # draining or unhealthy: the probe would say so soon
                    self.pool.mark_down(replica, "answered 503", alive=True)
            else:
                reason = upstream
            self.metrics.retries.labels(replica.url, reason).inc()
        return self._refuse(facts, refusals, bool(tried))

    async def _send(self, replica: Replica, request: Request, body: bytes) -> httpx.Response | str:
        """The replica's response with its headers read, or why there is none ("connect", "reset",
        "timeout")."""
        headers = {k: v for k, v in request.headers.items() if k not in _DROP_REQUEST}
        if not self.pass_client_auth:
            headers.pop("authorization", None)
        headers.update(replica.headers())
        upstream = self.client.build_request(request.method, f"{replica.url}{request.url.path}",
                                             params=request.url.query or None, headers=headers, content=body)
        try:
            return await self.client.send(upstream, stream=True)
        except httpx.ConnectError as exc:
            self.pool.mark_down(replica, f"connection failed: {exc}")
            return "connect"
        except httpx.TimeoutException:
            return "timeout"
        except (httpx.TransportError, OSError, AttributeError) as exc:     # reset, or closed before a response
            # A dying replica. AttributeError too: httpcore asks anyio for the peer of a socket the replica's
            # death closed under it ('NoneType' object has no attribute 'getpeername'), a 500 otherwise.
            self.pool.mark_down(replica, f"{type(exc).__name__}: {exc}")
            return "reset"

    def _relay(self, replica: Replica, upstream: httpx.Response) -> StreamingResponse:
        headers = {k: v for k, v in upstream.headers.items() if k not in _DROP_RESPONSE}
        sse = upstream.headers.get("content-type", "").startswith("text/event-stream")
        status = upstream.status_code
        outcome = ["ok" if status < 400 else "client_error" if status < 500 else "server_error"]
        closed = False

        async def close() -> None:
            nonlocal closed
            if not closed:
                closed = True
                await upstream.aclose()
                self.routing.done(replica)
                self.metrics.requests.labels(replica.url, outcome[0]).inc()
        return _RelayResponse(self._body(replica, upstream, sse, outcome), close, status_code=status,
                              headers=headers)

    async def _body(self, replica: Replica, upstream: httpx.Response, sse: bool,
                    outcome: list[str]) -> AsyncIterator[bytes]:
        pending = b""
        try:
            async for chunk in upstream.aiter_raw():
                if not sse:
                    yield chunk
                    continue
                pending += chunk
                end = pending.rfind(b"\n\n")
                if end >= 0:
                    yield pending[:end + 2]
                    pending = pending[end + 2:]
            if pending:
                yield pending
        except httpx.HTTPError as exc:
            outcome[0] = "broken"
            logger.warning("the response from %s broke mid-way: %s: %s", replica.url, type(exc).__name__, exc)
            if not sse:
                raise       # a cut JSON body cannot be mended: the client sees the connection close
            yield _error_event(f"the replica's stream broke mid-way: {type(exc).__name__}")

    def _refuse(self, facts: RequestFacts, refusals: list[httpx.Response], tried: bool) -> JSONResponse:
        """The router's own answer when no replica took the request."""
        if refusals and all(r.status_code == 429 for r in refusals):
            outcome, status, kind = "overloaded", 429, "rate_limit_error"
            message = "every replica tried is at capacity; retry later"
        elif not tried and not self.pool.known(facts.model) and not (self.lora and self.lora.path_of(facts.model)):
            self.metrics.requests.labels("none", "client_error").inc()
            return _error(404, f"no replica serves the model {facts.model!r}", "NotFoundError", "model")
        else:
            outcome, status, kind = "unavailable", 503, "service_unavailable"
            message = ("no healthy replica serves this model now" if not tried else
                       "every replica tried failed before answering; retry later")
        self.metrics.requests.labels("none", outcome).inc()
        return _error(status, message, kind, None, retry_after=_retry_after(refusals))


class _RelayResponse(StreamingResponse):
    """Closes the replica's response however this one ends, even when the client left before its body was
    started (an unstarted generator's `finally` never runs; admission.CountedStreamingResponse's reason)."""

    def __init__(self, content: AsyncIterator[bytes], close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._close = close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._close()


def _retry_after(refusals: list[httpx.Response]) -> int:
    """The longest Retry-After the replicas gave (in seconds), else the default."""
    values = [int(r.headers["retry-after"]) for r in refusals if r.headers.get("retry-after", "").isdigit()]
    return max(values, default=DEFAULT_RETRY_AFTER_S)


def _error(status: int, message: str, kind: str, param: str | None, retry_after: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
    body = {"error": {"message": message, "type": kind, "param": param, "code": status}}
    return JSONResponse(body, status_code=status, headers=headers)


def _error_event(message: str) -> bytes:
    error = {"error": {"message": message, "type": "service_unavailable", "param": None, "code": 503}}
    return f"data: {json.dumps(error)}\n\ndata: [DONE]\n\n".encode()
