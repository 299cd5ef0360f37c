"""Graceful drain: stop admitting, let what is in flight finish, then exit.

On SIGTERM (cli.serve) or `POST /drain` the server turns unready: `/health` answers 503 so that a router or
Kubernetes takes it out of rotation, and every new request gets 503 with `Retry-After` (a router retries it
elsewhere). Requests already in flight, streams included, run to their end, for at most --shutdown-timeout
seconds; then the server is told to exit.

In-flight requests are counted here, in plain ASGI middleware around the whole app, rather than in the
generation routes: a stream counts until its last byte is sent, and every route (embeddings, tokenize, LoRA
loads) is covered without each remembering to.
"""
from __future__ import annotations

import asyncio
import json
import logging
import signal
from collections.abc import Callable
from types import FrameType

import uvicorn

from pagedserve.frontend.http.guards import Receive, Scope, Send, route_path

logger = logging.getLogger(__name__)

# Paths that neither count as in flight nor are refused while draining (the probes and the drain itself);
# /health is answered here while draining.
UNCOUNTED_PATHS = frozenset({"/health", "/metrics", "/version", "/drain"})
RETRY_AFTER_S = 1


class Drain:
    """The server's drain state; `exit_server` (set by whoever runs the server) is called once drained."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s
        self.draining = False
        self.in_flight = 0
        self.exit_server: Callable[[], None] | None = None
        self._idle: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None

    def enter(self) -> None:
        self.in_flight += 1

    def leave(self) -> None:
        self.in_flight -= 1
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()

    def begin(self, reason: str) -> None:
        """Start draining (again: nothing more happens); must run on the server's event loop."""
        if self.draining:
            return
        self.draining = True
        logger.info("draining (%s): %d requests in flight, waiting up to %.0f s", reason, self.in_flight,
                    self.timeout_s)
        self._idle = asyncio.Event()
        if self.in_flight == 0:
            self._idle.set()
        self._task = asyncio.get_running_loop().create_task(self._finish(self._idle))

    async def _finish(self, idle: asyncio.Event) -> None:
        try:
            await asyncio.wait_for(idle.wait(), self.timeout_s)
            logger.info("drained: no request in flight")
        except asyncio.TimeoutError:
            logger.warning("--shutdown-timeout (%.0f s) passed with %d requests in flight; exiting anyway",
                           self.timeout_s, self.in_flight)
        if self.exit_server is not None:
            self.exit_server()


class DrainMiddleware:
    """Counts requests in flight and, while draining, answers 503 with Retry-After instead of the app."""

    def __init__(self, app: Callable, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = route_path(scope)
        if self.drain.draining and path not in UNCOUNTED_PATHS - {"/health"}:
            message = "the server is draining" if path == "/health" else "the server is draining: retry elsewhere"
            await _send_unavailable(send, message)
            return
        if path in UNCOUNTED_PATHS:
            await self.app(scope, receive, send)
            return
        self.drain.enter()
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.leave()


async def _send_unavailable(send: Send, message: str) -> None:
    body = json.dumps({"error": {"message": message, "type": "service_unavailable", "param": None,
                                 "code": 503}}).encode()
    await send({"type": "http.response.start", "status": 503,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            (b"retry-after", str(RETRY_AFTER_S).encode())]})
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn's Server, but a first SIGTERM drains before it exits, and the exit is then 0 (a rolling update
    asked for the stop; nothing failed). SIGINT, and a second SIGTERM, stop at once as before."""

    def __init__(self, config: uvicorn.Config, drain: Drain) -> None:
        super().__init__(config)
        self.drain = drain
        self._loop: asyncio.AbstractEventLoop | None = None
        drain.exit_server = self._exit_drained

    async def startup(self, sockets: list | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().startup(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.drain.draining and self._loop is not None:
            # A signal handler runs between two bytecodes of the loop's own thread: hand the drain to the loop.
            self._loop.call_soon_threadsafe(self.drain.begin, "SIGTERM")
            return
        super().handle_exit(sig, frame)

    def _exit_drained(self) -> None:
        self.should_exit = True       # not a captured signal, so uvicorn re-raises none after its shutdown
