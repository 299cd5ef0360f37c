"""A streamed response as OpenAI's typed events, each numbered by `sequence_number`.

The chat path's parser (frontend/openai/chat_output.py) turns each piece of generated text into a delta of reasoning,
content and tool calls; this turns those deltas into output items: one item is open at a time (reasoning, then
a message, then each function call, as the model wrote them), and a delta of another kind closes it first.

    response.created, response.in_progress,
    per item: response.output_item.added,
        message:   response.content_part.added, response.output_text.delta..., response.output_text.done,
                   response.content_part.done
        reasoning: response.content_part.added, response.reasoning_text.delta..., response.reasoning_text.done,
                   response.content_part.done
        call:      response.function_call_arguments.delta..., response.function_call_arguments.done
    response.output_item.done; then response.completed (response.incomplete when cut at max_output_tokens).
"""
from __future__ import annotations

import json
from typing import Any, Optional

from pagedserve.frontend.responses.items import (ResponseEnvelope, function_call_item, message_item, new_id,
                                                 output_text_part, reasoning_item)

Event = dict[str, Any]


def sse_event(event: Event) -> str:
    return f"event: {event['type']}\ndata: {json.dumps(event, ensure_ascii=False)}\n\n"


class ResponseEvents:
    def __init__(self, envelope: ResponseEnvelope) -> None:
        self.envelope = envelope
        self.output: list[dict[str, Any]] = []      # the items closed so far
        self._seq = 0
        self._open: Optional[dict[str, Any]] = None     # the item being written
        self._text = ""                                 # its text (or arguments) so far
        self._logprobs: list[dict[str, Any]] = []
        self._call_index = -1                           # the chat delta's index of the open call

    def event(self, kind: str, **fields: Any) -> Event:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}

    def opening(self) -> list[Event]:
        body = self.envelope.body("in_progress", [])
        return [self.event("response.created", response=body), self.event("response.in_progress", response=body)]

    def delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]]) -> list[Event]:
        """Events for one chat delta (reasoning_content, content, tool_calls) and its tokens' logprobs."""
        events: list[Event] = []
        if delta.get("reasoning_content"):
            events += self._write("reasoning", delta["reasoning_content"])
        if delta.get("content"):
            events += self._write("message", delta["content"], logprobs)
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if "id" in call:
                events += self._close()
                self._call_index = call["index"]
                self._open = function_call_item(new_id("fc"), new_id("call"), fn.get("name") or "", "",
                                                status="in_progress")
                events.append(self.event("response.output_item.added", output_index=len(self.output),
                                         item=dict(self._open)))
            if fn.get("arguments") and call["index"] == self._call_index:
                self._text += fn["arguments"]
                events.append(self.event("response.function_call_arguments.delta", item_id=self._open["id"],
                                         output_index=len(self.output), delta=fn["arguments"]))
        return events

    def closing(self) -> list[Event]:
        """Close the open item: the text is all written."""
        return self._close()

    def final(self, status: str, usage: dict[str, Any], incomplete: Optional[dict[str, str]]) -> Event:
        kind = "response.incomplete" if status == "incomplete" else "response.completed"
        return self.event(kind, response=self.final_body(status, usage, incomplete))

    def final_body(self, status: str, usage: dict[str, Any], incomplete: Optional[dict[str, str]]) -> dict[str, Any]:
        return self.envelope.body(status, self.output, usage, incomplete)

    # ---------------------------------------------------------------- items

    def _write(self, kind: str, text: str, logprobs: Optional[list[dict[str, Any]]] = None) -> list[Event]:
        events: list[Event] = []
        if self._open is None or self._open["type"] != kind:
            events += self._close()
            events += self._start(kind)
        self._text += text
        where = dict(item_id=self._open["id"], output_index=len(self.output), content_index=0)
        if kind == "message":
            self._logprobs += logprobs or []
            events.append(self.event("response.output_text.delta", **where, delta=text, logprobs=logprobs or []))
        else:
            events.append(self.event("response.reasoning_text.delta", **where, delta=text))
        return events

    def _start(self, kind: str) -> list[Event]:
        if kind == "message":
            self._open, part = message_item(new_id("msg"), "", None, status="in_progress"), output_text_part("", None)
        else:
            self._open, part = reasoning_item(new_id("rs"), None), {"type": "reasoning_text", "text": ""}
        index = len(self.output)
        return [self.event("response.output_item.added", output_index=index, item=dict(self._open)),
                self.event("response.content_part.added", item_id=self._open["id"], output_index=index,
                           content_index=0, part=part)]

    def _close(self) -> list[Event]:
        item, text = self._open, self._text
        if item is None:
            return []
        index = len(self.output)
        where = dict(item_id=item["id"], output_index=index)
        if item["type"] == "message":
            done = message_item(item["id"], text, self._logprobs)
            part = done["content"][0]
            events = [self.event("response.output_text.done", **where, content_index=0, text=text,
                                 logprobs=self._logprobs),
                      self.event("response.content_part.done", **where, content_index=0, part=part)]
        elif item["type"] == "reasoning":
            done = reasoning_item(item["id"], text)
            events = [self.event("response.reasoning_text.done", **where, content_index=0, text=text),
                      self.event("response.content_part.done", **where, content_index=0,
                                 part=done["content"][0])]
        else:
            done = function_call_item(item["id"], item["call_id"], item["name"], text or "{}")
            events = [self.event("response.function_call_arguments.done", **where, name=item["name"],
                                 arguments=done["arguments"])]
        events.append(self.event("response.output_item.done", output_index=index, item=done))
        self.output.append(done)
        self._open, self._text, self._logprobs, self._call_index = None, "", [], -1
        return events
