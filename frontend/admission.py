"""Admission control: refuse new generation requests (HTTP 429) instead of queueing without bound."""
from __future__ import annotations

from collections.abc import AsyncIterator, Callable

from pagedserve.frontend.async_client import AsyncEngineClient


class Admission:
    """Two bounds: requests this server has in flight (its own), and the engine core's waiting queue
    (shared by every client). The core enforces the queue bound exactly when a request arrives; the
    check here, on the core's last reported queue length, answers before a stream has sent its 200."""

    def __init__(self, engine: AsyncEngineClient, max_concurrent: int | None) -> None:
        self.engine = engine
        self.max_concurrent = max_concurrent
        self.max_waiting = engine.config.scheduler.max_waiting_requests
        self.in_flight = 0

    def refusal(self) -> tuple[str, str] | None:
        """(reason, message) if a new request must be refused now, else None."""
        if self.max_concurrent is not None and self.in_flight >= self.max_concurrent:
            return "concurrency", (f"this server already has {self.in_flight} requests in flight "
                                   f"(max_concurrent_requests={self.max_concurrent}); retry later")
        stats = self.engine.last_stats
        if self.max_waiting is not None and stats is not None and stats.num_waiting >= self.max_waiting:
            return "queue", (f"{stats.num_waiting} requests are already waiting "
                             f"(max_waiting_requests={self.max_waiting}); retry later")
        return None

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


async def release_after(stream: AsyncIterator[str], leave: Callable[[], None]) -> AsyncIterator[str]:
    """Pass a response stream through, counting its request out however the stream ends."""
    try:
        async for chunk in stream:
            yield chunk
    finally:
        leave()
