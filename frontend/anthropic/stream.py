"""A streamed message as Anthropic's events (an `event:` line naming each `data:` line's type):

    message_start (the message, empty, with the prompt's usage),
    per content block: content_block_start, content_block_delta... (text_delta, input_json_delta,
        thinking_delta), content_block_stop;
    message_delta (stop_reason, stop_sequence, usage), message_stop.

The chat path's parser (frontend/openai/chat_output.py) turns each piece of generated text into a delta of
reasoning, content and tool calls; this turns those deltas into blocks: one block is open at a time, and a
delta of another kind closes it first.
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedserve.frontend.anthropic.content import message_body, new_id

Event = dict[str, Any]


def sse_event(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class MessageEvents:
    def __init__(self, message_id: str, model: str) -> None:
        self.message_id, self.model = message_id, model
        self._index = -1                    # the open block's index; blocks are numbered from 0
        self._open: Optional[str] = None    # its type
        self._call = -1                     # the chat delta's index of the open tool call

    def start(self, usage: dict[str, Any]) -> Event:
        return {"type": "message_start",
                "message": message_body(self.message_id, self.model, [], None, None, usage)}

    def delta(self, delta: dict[str, Any]) -> list[Event]:
        """Events for one chat delta (reasoning_content, content, tool_calls)."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._write("thinking", {"type": "thinking_delta", "thinking": delta["reasoning_content"]})
        if delta.get("content"):
            events += self._write("text", {"type": "text_delta", "text": delta["content"]})
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:
                events += self._close()
                events += self._start({"type": "tool_use", "id": new_id("toolu"), "name": fn.get("name") or "",
                                       "input": {}})
                self._call = call["index"]
            if fn.get("arguments") and call["index"] == self._call:
                events.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events

    def finish(self, reason: str, sequence: Optional[str], usage: dict[str, Any]) -> list[Event]:
        return [*self._close(),
                {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": usage},
                {"type": "message_stop"}]

    # ---------------------------------------------------------------- blocks

    def _write(self, kind: str, delta: dict[str, Any]) -> list[Event]:
        events: list[Event] = []
        if self._open != kind:
            events += self._close()
            events += self._start({"type": "text", "text": ""} if kind == "text"
                                  else {"type": "thinking", "thinking": "", "signature": ""})
        events.append(self._delta(delta))
        return events

    def _start(self, block: dict[str, Any]) -> list[Event]:
        self._index += 1
        self._open = block["type"]
        return [{"type": "content_block_start", "index": self._index, "content_block": block}]

    def _delta(self, delta: dict[str, Any]) -> Event:
        return {"type": "content_block_delta", "index": self._index, "delta": delta}

    def _close(self) -> list[Event]:
        if self._open is None:
            return []
        self._open, self._call = None, -1
        return [{"type": "content_block_stop", "index": self._index}]
