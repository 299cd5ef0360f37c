"""Why a request was refused, as data: the request field at fault, and the kind of refusal (never a message
convention that a reader would have to parse back)."""
from __future__ import annotations

from typing import Optional

# EngineCoreOutput.error_kind / RequestOutput.error_kind values.
INVALID = "invalid"          # the request can never run as asked (HTTP 400)
OVERLOADED = "overloaded"    # refused for load, not queued: retrying later may work (HTTP 429)
SLEEPING = "sleeping"        # the engine sleeps (sleep mode) and refuses new requests until wake_up (HTTP 503)
ENGINE_DIED = "engine_died"  # its engine core died with it in flight (a data-parallel peer may serve a retry)


class RequestError(ValueError):
    """A request that can never run as asked (HTTP 400). `field` is the request field at fault (what an OpenAI
    error body's `param` names; None when no single field is), `message` the whole text the user reads."""

    def __init__(self, field: Optional[str], message: str) -> None:
        super().__init__(message)
        self.field = field
        self.message = message

    @classmethod
    def at(cls, field: str, detail: str) -> "RequestError":
        """The usual shape, whose message names the field first: `tools[0].function.name: <detail>`."""
        return cls(field, f"{field}: {detail}")


class EngineOverloadedError(ValueError):
    """The waiting queue is at its bound: the request was refused, not queued. Retrying later may work."""


class EngineSleepingError(ValueError):
    """The engine is asleep (sleep mode between RL rollouts) and refuses new requests until wake_up (HTTP 503)."""


def error_kind(exc: ValueError) -> str:
    if isinstance(exc, EngineSleepingError):
        return SLEEPING
    return OVERLOADED if isinstance(exc, EngineOverloadedError) else INVALID


def error_field(exc: BaseException) -> Optional[str]:
    """The request field an error is about, when it says (a RequestError)."""
    return exc.field if isinstance(exc, RequestError) else None
