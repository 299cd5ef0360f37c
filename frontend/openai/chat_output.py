"""ChatOutputParser: one chat choice's text as OpenAI message fields (reasoning, content, tool calls).

Order: the reasoning parser (when the server has one) takes the thinking off the front; the answer that
follows is then read for tool calls: a forced call (tool_choice required or named: the grammar made the answer
JSON) or the `--tool-call-parser` (tool_choice auto). Whole responses scan the final text once; streams send
the difference between the scan of the text so far and what was already sent, so the two always agree.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, Optional

from pagedserve.common.reasoning import REASONING_PARSERS
from pagedserve.frontend.parsers.reasoning_parser import ReasoningParser
from pagedserve.frontend.parsers.tool_parsers import TOOL_PARSERS
from pagedserve.frontend.parsers.tool_parsers.base import PartialCall, Scan, ToolParser, scan_object_list


def tool_call_id() -> str:
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


class NamedCallParser(ToolParser):
    """tool_choice naming a function: the answer is that function's arguments object."""

    def __init__(self, function: str) -> None:
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        args = text.strip()
        return Scan(calls=[PartialCall(self.function, args, final)] if args or final else [])


class RequiredCallsParser(ToolParser):
    """tool_choice required: the answer is a list of {"name": ..., "parameters": {...}} objects."""

    def scan(self, text: str, final: bool) -> Scan:
        body = text.lstrip()
        calls = scan_object_list(body, 1, ",", end="]") if body.startswith("[") else []
        return Scan(calls=[c for c in calls if c.name is not None])


@dataclass
class _Sent:
    reasoning: int = 0
    content: int = 0
    names: int = 0                                    # calls whose opening delta went out
    args: list[int] = field(default_factory=list)     # argument characters sent, per call
    ids: list[str] = field(default_factory=list)


class ChatOutputParser:
    """Per choice (it keeps the stream's state). Either part may be None: that step is skipped."""

    def __init__(self, reasoning: Optional[ReasoningParser], tools: Optional[ToolParser]) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.text = ""
        self.sent = _Sent()

    def _scan(self, text: str, final: bool) -> tuple[str, Scan]:
        reasoning, answer = self.reasoning.split(text, final) if self.reasoning else ("", text)
        if self.tools is None:
            return reasoning, Scan(content=answer)
        return reasoning, self.tools.scan(answer, final)

    def message(self, text: str) -> dict[str, Any]:
        """The whole response's message fields."""
        reasoning, scan = self._scan(text, final=True)
        msg: dict[str, Any] = {"role": "assistant", "content": scan.content or (None if scan.calls else "")}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning or None
        if self.tools is not None:
            msg["tool_calls"] = [{"id": tool_call_id(), "type": "function",
                                  "function": {"name": c.name, "arguments": c.arguments or "{}"}}
                                 for c in scan.calls]
        return msg

    def delta(self, new_text: str, final: bool) -> dict[str, Any]:
        """The stream delta for new text (empty when nothing can be sent yet)."""
        self.text += new_text
        reasoning, scan = self._scan(self.text, final)
        sent, out = self.sent, {}
        if len(reasoning) > sent.reasoning:
            out["reasoning_content"] = reasoning[sent.reasoning:]
            sent.reasoning = len(reasoning)
        if len(scan.content) > sent.content:
            out["content"] = scan.content[sent.content:]
            sent.content = len(scan.content)
        calls = self._call_deltas(scan.calls, final)
        if calls:
            out["tool_calls"] = calls
        return out

    def _call_deltas(self, calls: list[PartialCall], final: bool) -> list[dict[str, Any]]:
        sent, deltas = self.sent, []
        for i, call in enumerate(calls):
            args = call.arguments or ("{}" if final else "")
            if i >= sent.names:       # a new call: id, type and name first
                sent.ids.append(tool_call_id())
                sent.args.append(0)
                sent.names += 1
                deltas.append({"index": i, "id": sent.ids[i], "type": "function",
                               "function": {"name": call.name, "arguments": args}})
                sent.args[i] = len(args)
            elif len(args) > sent.args[i]:
                deltas.append({"index": i, "function": {"arguments": args[sent.args[i]:]}})
                sent.args[i] = len(args)
        return deltas

    @property
    def called(self) -> bool:
        """Whether the stream sent any tool call (its finish reason is then tool_calls)."""
        return self.sent.names > 0


def finish_reason(reason: Optional[str], called: bool) -> Optional[str]:
    return "tool_calls" if called and reason == "stop" else reason


def chat_parser_factory(tool_mode: Optional[str], tool_parser: Optional[str],
                        reasoning_parser: Optional[str]) -> Optional[Callable[[], ChatOutputParser]]:
    """What reads a chat request's choices: tool_mode is ProtocolTools.check_tools' answer (None, "auto",
    "required" or the forced function's name); None when the text is plain content."""
    if tool_mode is None and reasoning_parser is None:
        return None

    def make() -> ChatOutputParser:
        tools: Optional[ToolParser] = None
        if tool_mode == "auto":
            tools = TOOL_PARSERS[tool_parser]() if tool_parser else None
        elif tool_mode == "required":
            tools = RequiredCallsParser()
        elif tool_mode is not None:
            tools = NamedCallParser(tool_mode)
        reasoning = ReasoningParser(REASONING_PARSERS[reasoning_parser]) if reasoning_parser else None
        return ChatOutputParser(reasoning, tools)
    return make
