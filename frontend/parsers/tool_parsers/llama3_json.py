"""llama3_json: Llama 3.x writes calls as JSON objects {"name": ..., "parameters": {...}}, optionally after
<|python_tag|>, several separated by ';'. Text that does not start that way is all content."""
from __future__ import annotations

from pagedserve.frontend.parsers.tool_parsers.base import Scan, ToolParser, scan_object_list

TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3_json"

    def scan(self, text: str, final: bool) -> Scan:
        stripped = text.lstrip()
        if not final and (not stripped or TAG.startswith(stripped)):
            return Scan()                         # undecided: it may become a call
        body = stripped[len(TAG):].lstrip() if stripped.startswith(TAG) else stripped
        if not body.startswith("{"):
            return Scan(content=text) if (final or body) else Scan()
        calls = [c for c in scan_object_list(body, 0, ";") if c.name is not None]
        if final and not calls:
            return Scan(content=text)             # JSON, but not a call
        return Scan(calls=calls)
