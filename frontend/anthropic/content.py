"""The Messages API's output objects: the message, its content blocks, stop reason and usage.

Shared by whole messages (frontend/anthropic/serving.py) and streams (frontend/anthropic/stream.py).
"""
from __future__ import annotations

import json
import uuid
from typing import Any, Optional

from pagedserve.frontend.client.outputs import CompletionOutput


def new_id(prefix: str) -> str:
    """Anthropic's id shapes: msg_..., toolu_..."""
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def stop_reason(c: CompletionOutput, called: bool) -> tuple[str, Optional[str]]:
    """(stop_reason, stop_sequence) for a finished output: the engine's stop_reason is the stop string that
    matched (a token id, or None, for EOS)."""
    if c.finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if isinstance(c.stop_reason, str):
        return "stop_sequence", c.stop_reason
    return "end_turn", None


def usage(prompt_tokens: int, output_tokens: int, cached_tokens: int) -> dict[str, Any]:
    # Anthropic's input_tokens counts what was not read from the cache: input_tokens + cache_read_input_tokens
    # is the whole prompt (count_tokens' number). Filling the prefix cache costs nothing here: no creation.
    return {"input_tokens": prompt_tokens - cached_tokens, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached_tokens}


def tool_input(arguments: str) -> dict[str, Any]:
    """A call's arguments (JSON text) as tool_use's input object; a call cut off by max_tokens can be
    unfinished JSON, and its input is then empty (its stop_reason says why)."""
    try:
        value = json.loads(arguments or "{}")
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def content_blocks(message: dict[str, Any]) -> list[dict[str, Any]]:
    """A chat message (frontend/openai/chat_output.py's ChatOutputParser.message) as content blocks, in the
    order the model wrote them: thinking, text, tool_use."""
    blocks: list[dict[str, Any]] = []
    if message.get("reasoning_content"):
        # There is no signature to give: nothing here checks thinking that is sent back.
        blocks.append({"type": "thinking", "thinking": message["reasoning_content"], "signature": ""})
    if message.get("content"):
        blocks.append({"type": "text", "text": message["content"]})
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        blocks.append({"type": "tool_use", "id": new_id("toolu"), "name": fn["name"],
                       "input": tool_input(fn["arguments"])})
    return blocks


def message_body(message_id: str, model: str, content: list[dict[str, Any]], reason: Optional[str],
                 sequence: Optional[str], usage: dict[str, Any]) -> dict[str, Any]:
    return {"id": message_id, "type": "message", "role": "assistant", "model": model, "content": content,
            "stop_reason": reason, "stop_sequence": sequence, "usage": usage}
