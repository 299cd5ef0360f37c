"""One mapping from exceptions to OpenAI-shaped errors, for HTTP statuses and in-stream error events."""
from __future__ import annotations

from typing import Any

from pagedserve.common.errors import EngineOverloadedError, EngineSleepingError
from pagedserve.frontend.client.core_client import EngineDeadError


class ModelNotFoundError(LookupError):
    """A request named a model this server does not serve."""


def classify(exc: BaseException) -> tuple[int, str]:
    """(HTTP status, OpenAI error type) for an exception raised while serving a request."""
    if isinstance(exc, EngineSleepingError):       # before ValueError: it is one
        return 503, "service_unavailable"
    if isinstance(exc, EngineOverloadedError):     # before ValueError: it is one
        return 429, "overloaded_error"
    if isinstance(exc, EngineDeadError):
        return 503, "service_unavailable"
    if isinstance(exc, ModelNotFoundError):
        return 404, "NotFoundError"
    if isinstance(exc, ValueError):
        return 400, "invalid_request_error"
    return 500, "internal_server_error"


def error_payload(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}
