"""Errors the engine core reports to clients by message, recognisable on the other side of the socket."""
from __future__ import annotations

# The core's error outputs carry only a message string; this prefix marks "try again later" (HTTP 429),
# as opposed to a request that can never run (HTTP 400).
OVERLOADED_PREFIX = "overloaded: "


class EngineOverloadedError(ValueError):
    """The waiting queue is at its bound: the request was refused, not queued. Retrying later may work."""

    def __init__(self, detail: str) -> None:
        super().__init__(OVERLOADED_PREFIX + detail)


def is_overloaded(message: str | None) -> bool:
    return bool(message) and message.startswith(OVERLOADED_PREFIX)
