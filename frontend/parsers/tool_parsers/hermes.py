"""hermes: Qwen2.5, Qwen3 and Hermes models write each call as <tool_call>{"name": ..., "arguments": {...}}</tool_call>.
Content is the text before the first call (as vLLM's parser has it)."""
from __future__ import annotations

from pagedserve.frontend.parsers.tool_parsers.base import Scan, ToolParser, held_back, scan_call_object

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        first = text.find(START)
        if first < 0:
            return Scan(content=text if final else held_back(text, START))
        scan = Scan(content=text[:first])
        pos = first
        while (pos := text.find(START, pos)) >= 0:
            pos += len(START)
            stop = text.find(END, pos)
            body = text[pos:] if stop < 0 else text[pos:stop]
            if stop < 0 and not final:
                body = held_back(body, END)
            call = scan_call_object(body.strip())
            if call.name is not None:
                scan.calls.append(call)
            if stop < 0:
                break
            pos = stop + len(END)
        return scan
