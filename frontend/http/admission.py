"""Admission control: refuse new generation requests (HTTP 429) instead of queueing without bound."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from pagedserve.common.errors import EngineOverloadedError
from pagedserve.common.request_checks import check_waiting_room
from pagedserve.frontend.client.async_client import AsyncEngineClient
from pagedserve.frontend.http.metrics import Metrics


class Admission:
    """Two bounds: requests this server has in flight (its own), and the engine core's waiting queue
    (shared by every client). The core enforces the queue bound exactly when a request arrives; the
    check here, on the core's last reported queue length, answers before a stream has sent its 200."""

    def __init__(self, engine: AsyncEngineClient, max_concurrent: int | None, metrics: Metrics) -> None:
        self.engine = engine
        self.max_concurrent = max_concurrent
        self.max_waiting = engine.info.max_waiting_requests
        self.metrics = metrics
        self.in_flight = 0

    def check(self) -> None:
        """EngineOverloadedError (HTTP 429) if a new request must be refused now."""
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            self.count_refusal("concurrency")
            raise EngineOverloadedError(f"this server already has {self.in_flight} requests in flight "
                                        f"(max_concurrent_requests={self.max_concurrent}); retry later")
        stats = self.engine.last_stats
        if stats is None:
            return
        try:
            check_waiting_room(stats.num_waiting, self.max_waiting)    # the core's own rule, on its last count
        except EngineOverloadedError:
            self.count_refusal("queue")
            raise

    def count_refusal(self, reason: str) -> None:
        """reason: "concurrency" (this server's in-flight bound) or "queue" (the engine's waiting bound)."""
        self.metrics.rejected.labels(self.metrics.model, reason).inc()

    def enter(self) -> Callable[[], None]:
        """Count one request in; the returned function counts it out (calling it again does nothing)."""
        self.in_flight += 1
        done = False

        def leave() -> None:
            nonlocal done
            if not done:
                done = True
                self.in_flight -= 1
        return leave


class CountedStreamingResponse(StreamingResponse):
    """A stream that counts its request out however the response ends, even if the client left before
    its body was started (an unstarted generator's `finally` never runs)."""

    def __init__(self, content: AsyncIterator[str], leave: Callable[[], None], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._leave = leave

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._leave()
