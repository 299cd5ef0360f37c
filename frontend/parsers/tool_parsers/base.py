"""What every tool-call parser shares: a scan of the model's text so far into content and (partial) calls.

A parser's `scan(text, final)` is a pure function of the text generated so far. It must be prefix-consistent:
as the text grows, the content and each call's name and arguments only grow (text that might still turn out to
be a marker is held back until it is decided). Then whole-text extraction is one scan of the final text, and
streaming is the difference between two scans (frontend/openai/chat_output.py), so a stream always reassembles into
what the whole response says.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

_DECODER = json.JSONDecoder()
_NAME = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')


@dataclass
class PartialCall:
    name: Optional[str] = None      # known once its string is closed
    arguments: str = ""             # the arguments' JSON text so far (the raw text the model wrote)
    complete: bool = False


@dataclass
class Scan:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


class ToolParser:
    """One `--tool-call-parser`. keeps_special_tokens: its markers are special tokens, so the request must
    not strip them from the text."""
    name: str = ""
    keeps_special_tokens: bool = False

    def scan(self, text: str, final: bool) -> Scan:
        raise NotImplementedError


def held_back(text: str, marker: str) -> str:
    """text without a trailing partial `marker` (it may be the start of one: not content yet)."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return text[:-k]
    return text


def scan_call_object(body: str, args_keys: tuple[str, ...] = ("arguments", "parameters")) -> PartialCall:
    """One {"name": ..., "arguments": {...}} object, complete or cut off anywhere."""
    call = PartialCall()
    key = re.search(r'"(%s)"\s*:\s*' % "|".join(args_keys), body)
    args_start = key.end() if key else None
    args_end = None
    if args_start is not None and args_start < len(body):
        try:
            _, args_end = _DECODER.raw_decode(body, args_start)
            call.arguments = body[args_start:args_end]
        except ValueError:
            call.arguments = body[args_start:].rstrip()   # still being written: all of it is the value
    # The name is a top-level key: search outside the arguments' text (they may have a "name" of their own).
    outside = body if key is None else body[:key.start()] + ("" if args_end is None else " " + body[args_end:])
    if (m := _NAME.search(outside)) is not None:
        call.name = json.loads(f'"{m.group(1)}"')
    try:
        _DECODER.raw_decode(body.lstrip())
        call.complete = True
    except ValueError:
        pass
    if call.name is None:
        call.arguments = ""     # arguments are sent after the name, never before
    return call


def scan_object_list(text: str, pos: int, separators: str, end: str = "") -> list[PartialCall]:
    """Call objects from text[pos:], separated by any of `separators` (and whitespace), up to `end`."""
    calls = []
    while pos < len(text):
        while pos < len(text) and (text[pos].isspace() or text[pos] in separators):
            pos += 1
        if pos >= len(text) or (end and text.startswith(end, pos)) or text[pos] != "{":
            break
        try:
            _, stop = _DECODER.raw_decode(text, pos)
        except ValueError:
            calls.append(scan_call_object(text[pos:]))
            break
        calls.append(scan_call_object(text[pos:stop]))
        pos = stop
    return calls
