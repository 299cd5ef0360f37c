"""mistral: Mistral models write [TOOL_CALLS] then a JSON list of {"name": ..., "arguments": {...}} objects.
[TOOL_CALLS] is a special token, so requests keep special tokens in the text. Content is the text before it."""
from __future__ import annotations

from pagedserve.frontend.parsers.tool_parsers.base import Scan, ToolParser, held_back, scan_object_list

MARKER = "[TOOL_CALLS]"


class MistralToolParser(ToolParser):
    name = "mistral"
    keeps_special_tokens = True

    def scan(self, text: str, final: bool) -> Scan:
        at = text.find(MARKER)
        if at < 0:
            return Scan(content=text if final else held_back(text, MARKER))
        rest = text[at + len(MARKER):].lstrip()
        if rest.startswith("["):
            calls = scan_object_list(rest, 1, ",", end="]")
        else:                                     # a single object, without the list
            calls = scan_object_list(rest, 0, ",")
        return Scan(content=text[:at], calls=[c for c in calls if c.name is not None])
