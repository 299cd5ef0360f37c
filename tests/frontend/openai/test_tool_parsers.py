"""Tool-call and reasoning parsers: whole text, and the same text streamed in every split (each position, and
random chunkings) reassembles into the same content, reasoning and calls."""
from __future__ import annotations

import json
import random

import pytest

from pagedserve.common.reasoning import REASONING_PARSERS
from pagedserve.frontend.openai.chat_output import ChatOutputParser, NamedCallParser, RequiredCallsParser, finish_reason
from pagedserve.frontend.parsers.reasoning_parser import ReasoningParser
from pagedserve.frontend.parsers.tool_parsers import TOOL_PARSERS

WEATHER = {"city": "Paris", "unit": "celsius", "name": "inner keys named name are arguments"}
CASES = [
    # (parser, text, expected content, expected [(name, arguments dict)])
    ("hermes", 'Let me check.<tool_call>\n{"name": "get_weather", "arguments": %s}\n</tool_call>'
     % json.dumps(WEATHER), "Let me check.", [("get_weather", WEATHER)]),
    ("hermes", '<tool_call>{"arguments": {"q": "a\\"b"}, "name": "search"}</tool_call>\n<tool_call>'
     '{"name": "now", "arguments": {}}</tool_call>', "", [("search", {"q": 'a"b'}), ("now", {})]),
    ("hermes", "No tools needed: 1 < 2 and <tool is not a tag.", "No tools needed: 1 < 2 and <tool is not a tag.",
     []),
    ("llama3_json", '<|python_tag|>{"name": "get_weather", "parameters": %s}; {"name": "now", "parameters": {}}'
     % json.dumps(WEATHER), "", [("get_weather", WEATHER), ("now", {})]),
    ("llama3_json", '{"name": "add", "parameters": {"a": 1, "b": [2, 3]}}', "", [("add", {"a": 1, "b": [2, 3]})]),
    ("llama3_json", "The answer is 4.", "The answer is 4.", []),
    ("llama3_json", '{"answer": 4}', '{"answer": 4}', []),
    ("mistral", 'Sure [TOOL_CALLS][{"name": "get_weather", "arguments": %s}, {"name": "now", "arguments": {}}]'
     % json.dumps(WEATHER), "Sure ", [("get_weather", WEATHER), ("now", {})]),
    ("mistral", "Plain [TOOL answer", "Plain [TOOL answer", []),
]


def _whole(parser: ChatOutputParser, text: str) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    msg = parser.message(text)
    return (msg["content"], msg.get("reasoning_content"),
            [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])])


def _streamed(parser: ChatOutputParser, pieces: list[str]) -> tuple[str | None, str | None, list[tuple[str, str]]]:
    content, reasoning, calls = "", "", {}
    for k, piece in enumerate(pieces):
        delta = parser.delta(piece, final=k == len(pieces) - 1)
        content += delta.get("content", "")
        reasoning += delta.get("reasoning_content", "")
        for tc in delta.get("tool_calls", []):
            if "id" in tc:          # the opening delta: id, type and name before any other fragment
                assert tc["index"] not in calls and tc["type"] == "function" and tc["id"].startswith("chatcmpl-tool-")
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    listed = [tuple(calls[i]) for i in sorted(calls)]
    assert sorted(calls) == list(range(len(calls)))
    return (content or (None if listed else "")), reasoning or None, listed


def _splits(text: str) -> list[list[str]]:
    rng = random.Random(len(text))
    out = [[text[:i], text[i:]] for i in range(1, len(text))] + [list(text)]
    for _ in range(20):
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        out.append([text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])])
    return out


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_tool_parser_whole_and_streamed(name: str, text: str, content: str, calls: list) -> None:
    make = lambda: ChatOutputParser(None, TOOL_PARSERS[name]())  # noqa: E731
    whole = _whole(make(), text)
    assert whole[0] == (content or (None if calls else ""))
    assert [(n, json.loads(a)) for n, a in whole[2]] == calls
    for pieces in _splits(text):
        assert _streamed(make(), pieces) == whole, pieces


REASONING = [
    ("qwen3", "<think>Two and two.\nFour.</think>\n\nThe answer is 4.", "Two and two.\nFour.", "\n\nThe answer is 4."),
    ("qwen3", "No thinking here, <think> later is content.", None, "No thinking here, <think> later is content."),
    ("qwen3", "<think>cut off before the end", "cut off before the end", ""),
    ("deepseek_r1", "thinking without the opening marker</think>answer", "thinking without the opening marker",
     "answer"),
    ("deepseek_r1", "<think>opened</think>answer", "opened", "answer"),
    ("deepseek_r1", "all thinking, never closed", "all thinking, never closed", ""),
]


@pytest.mark.parametrize("name,text,reasoning,content", REASONING)
def test_reasoning_parser_whole_and_streamed(name: str, text: str, reasoning: str | None, content: str) -> None:
    make = lambda: ChatOutputParser(ReasoningParser(REASONING_PARSERS[name]), None)  # noqa: E731
    whole = _whole(make(), text)
    assert whole[:2] == (content, reasoning)
    for pieces in _splits(text):
        assert _streamed(make(), pieces) == whole, pieces


def test_reasoning_then_tool_call() -> None:
    text = '<think>I need the weather.</think>\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    make = lambda: ChatOutputParser(ReasoningParser(REASONING_PARSERS["qwen3"]), TOOL_PARSERS["hermes"]())  # noqa
    whole = _whole(make(), text)
    assert whole == ("\n", "I need the weather.", [("get_weather", '{"city": "Oslo"}')])
    for pieces in _splits(text):
        assert _streamed(make(), pieces) == whole


@pytest.mark.parametrize("make,text,calls", [
    (lambda: NamedCallParser("get_weather"), ' {"city": "Rome", "days": [1, 2]} ',
     [("get_weather", '{"city": "Rome", "days": [1, 2]}')]),
    (lambda: RequiredCallsParser(), '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
     [("a", '{"x": 1}'), ("b", "{}")]),
])
def test_forced_calls(make, text: str, calls: list) -> None:
    whole = _whole(ChatOutputParser(None, make()), text)
    assert whole == (None, None, calls)
    for pieces in _splits(text):
        assert _streamed(ChatOutputParser(None, make()), pieces) == whole


def test_finish_reason_is_tool_calls_only_after_a_call_that_stopped() -> None:
    assert finish_reason("stop", True) == "tool_calls"
    assert finish_reason("length", True) == "length"
    assert finish_reason("stop", False) == "stop"
    assert finish_reason(None, True) is None
