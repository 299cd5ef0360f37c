"""The Responses API's output objects: the response envelope, its output items, usage and status.

Shared by whole responses (frontend/responses/serving.py) and streams (frontend/responses/stream.py), so a
streamed response's final snapshot is the same object a whole one would have been.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Optional

from pagedserve.frontend.responses.protocol import ResponsesRequest


def new_id(prefix: str) -> str:
    """OpenAI's id shapes: resp_..., msg_..., fc_..., rs_..., call_..."""
    return f"{prefix}_{uuid.uuid4().hex}"


def output_text_part(text: str, logprobs: Optional[list[dict[str, Any]]]) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": logprobs or []}


def message_item(item_id: str, text: str, logprobs: Optional[list[dict[str, Any]]],
                 status: str = "completed") -> dict[str, Any]:
    content = [output_text_part(text, logprobs)] if status == "completed" else []
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def reasoning_item(item_id: str, text: Optional[str]) -> dict[str, Any]:
    """text None: the item as it opens in a stream, before its content."""
    content = [] if text is None else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content}


def function_call_item(item_id: str, call_id: str, name: str, arguments: str,
                       status: str = "completed") -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


def output_items(message: dict[str, Any], logprobs: Optional[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """A chat message (frontend/openai/chat_output.py's ChatOutputParser.message) as output items, in the order the
    model wrote them: reasoning, text, calls."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_id("rs"), message["reasoning_content"]))
    if message.get("content"):
        items.append(message_item(new_id("msg"), message["content"], logprobs))
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        items.append(function_call_item(new_id("fc"), new_id("call"), fn["name"], fn["arguments"]))
    return items


def status_of(finish_reason: Optional[str]) -> tuple[str, Optional[dict[str, str]]]:
    """(status, incomplete_details) for the engine's finish reason."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "abort":
        return "cancelled", None
    if finish_reason == "error":
        return "failed", None
    return "completed", None


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    # cache_write_tokens is OpenAI's billed cache write; the prefix cache here costs nothing to fill: 0.
    return {"input_tokens": input_tokens,
            "input_tokens_details": {"cached_tokens": cached_tokens, "cache_write_tokens": 0},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


@dataclass
class ResponseEnvelope:
    """What every snapshot of one response shares: its id and the request's settings, echoed."""
    request: ResponsesRequest
    model: str
    id: str = field(default_factory=lambda: new_id("resp"))
    created_at: int = field(default_factory=lambda: int(time.time()))

    def body(self, status: str, output: list[dict[str, Any]], usage: Optional[dict[str, Any]] = None,
             incomplete_details: Optional[dict[str, str]] = None,
             error: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        r = self.request
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": error, "incomplete_details": incomplete_details,
            "instructions": r.instructions, "max_output_tokens": r.max_output_tokens,
            "max_tool_calls": r.max_tool_calls, "model": self.model, "output": output,
            "parallel_tool_calls": r.parallel_tool_calls if r.parallel_tool_calls is not None else True,
            "previous_response_id": r.previous_response_id,
            "reasoning": {"effort": (r.reasoning or {}).get("effort"), "summary": None},
            "service_tier": "auto", "store": r.store,
            "temperature": r.temperature if r.temperature is not None else 1.0,
            "text": {"format": (r.text or {}).get("format") or {"type": "text"}},
            "tool_choice": r.tool_choice if r.tool_choice is not None else ("auto" if r.tools else "none"),
            "tools": r.tools or [], "top_logprobs": r.top_logprobs,
            "top_p": r.top_p if r.top_p is not None else 1.0, "truncation": r.truncation or "disabled",
            "usage": usage, "user": r.user, "metadata": r.metadata or {},
        }
