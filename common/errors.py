"""Why the engine core refused a request: an explicit kind travels with the error, never a message convention."""
from __future__ import annotations

# EngineCoreOutput.error_kind / RequestOutput.error_kind values.
INVALID = "invalid"          # the request can never run as asked (HTTP 400)
OVERLOADED = "overloaded"    # refused for load, not queued: retrying later may work (HTTP 429)


class EngineOverloadedError(ValueError):
    """The waiting queue is at its bound: the request was refused, not queued. Retrying later may work."""


def error_kind(exc: ValueError) -> str:
    return OVERLOADED if isinstance(exc, EngineOverloadedError) else INVALID
