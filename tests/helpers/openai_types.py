"""The official SDK's own pydantic types as the oracle for the Responses API's objects: its client builds them
without validation, so tests validate what the server sent against them explicitly."""
from __future__ import annotations

from typing import Any, get_args

from openai.types.responses import Response, ResponseStreamEvent

# The SDK's stream event classes by their `type`.
_EVENTS = {get_args(cls.model_fields["type"].annotation)[0]: cls for cls in get_args(get_args(ResponseStreamEvent)[0])}


def validate_event(event: dict[str, Any]) -> None:
    """ValidationError unless the event is one of the SDK's stream events, fully formed; KeyError for an event
    type the SDK does not know."""
    _EVENTS[event["type"]].model_validate(event)


def validate_response(body: dict[str, Any]) -> Response:
    return Response.model_validate(body)
