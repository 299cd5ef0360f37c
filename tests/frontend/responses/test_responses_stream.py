"""The Responses API's objects without a server: stream events from the chat path's real parsers (reasoning,
text, forced calls) validated by the official SDK's own types, whole bodies likewise, the store's LRU and TTL,
and the translation of input items into chat messages."""
from __future__ import annotations

from typing import Any

import pytest
from openai.types.responses import Response

from pagedserve.common.errors import RequestError
from pagedserve.common.reasoning import REASONING_PARSERS
from pagedserve.frontend.openai.chat_output import ChatOutputParser, RequiredCallsParser
from pagedserve.frontend.parsers.reasoning_parser import ReasoningParser
from pagedserve.frontend.responses.items import ResponseEnvelope, output_items, usage
from pagedserve.frontend.responses.protocol import ResponsesRequest, chat_messages, responses_field
from pagedserve.frontend.responses.store import ResponseNotFoundError, ResponsesStore, StoredResponse
from pagedserve.frontend.responses.stream import ResponseEvents
from pagedserve.tests.helpers.openai_types import validate_event



def _stream(text: str, parser: ChatOutputParser, piece: int = 3) -> list[dict[str, Any]]:
    """The events of `text` arriving `piece` characters at a time, each validated as the SDK's type."""
    events = ResponseEvents(ResponseEnvelope(ResponsesRequest(input="q"), "m"))
    out = events.opening()
    for start in range(0, len(text), piece):
        chunk = text[start:start + piece]
        out += events.delta(parser.delta(chunk, final=start + piece >= len(text)), [])
    out += events.closing()
    out.append(events.final("completed", usage(3, 9, 0, 2), None))
    for event in out:
        validate_event(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def _reasoning() -> ReasoningParser:
    return ReasoningParser(REASONING_PARSERS["qwen3"])


def test_reasoning_then_text_items():
    text = "<think>let me see</think>It is sunny."
    events = _stream(text, ChatOutputParser(_reasoning(), None))
    kinds = [e["type"] for e in events]
    assert kinds.index("response.reasoning_text.done") < kinds.index("response.output_text.delta")
    thought = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_text.delta")
    said = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert (thought, said) == ("let me see", "It is sunny.")
    final = Response.model_validate(events[-1]["response"])
    whole = output_items(ChatOutputParser(_reasoning(), None).message(text), None)
    strip = [{k: v for k, v in item.items() if k != "id"} for item in whole]
    assert [{k: v for k, v in item.model_dump(exclude_none=True).items() if k != "id"} for item in final.output] \
        == [{k: v for k, v in item.items() if v is not None} for item in strip]
    assert final.output_text == "It is sunny." and final.output[0].type == "reasoning"


def test_forced_calls_stream_as_argument_events():
    text = '[{"name": "f", "parameters": {"a": 1}}, {"name": "g", "parameters": {}}]'
    events = _stream(text, ChatOutputParser(None, RequiredCallsParser()), piece=5)
    assert not any(e["type"].startswith("response.output_text") for e in events)
    final = Response.model_validate(events[-1]["response"])
    assert [(c.name, c.arguments) for c in final.output] == [("f", '{"a": 1}'), ("g", "{}")]
    for index, call in enumerate(final.output):
        deltas = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta"
                         and e["output_index"] == index)
        assert deltas == call.arguments and call.id.startswith("fc_")
        assert call.call_id.startswith("call_")


def test_store_lru_and_ttl():
    now = [0.0]
    store = ResponsesStore(2, 10.0, clock=lambda: now[0])
    for rid in "abc":
        if rid == "c":
            store.get("a")               # a is used: b is now the least recently used
        store.put(rid, StoredResponse({"id": rid}, []))
    with pytest.raises(ResponseNotFoundError):
        store.get("b")
    assert store.get("a").body == {"id": "a"} and len(store) == 2
    now[0] = 9.9
    store.put("a", StoredResponse({"id": "a2"}, []))      # stored again: a new deadline
    now[0] = 10.0
    assert len(store) == 1 and store.get("a").body == {"id": "a2"}
    with pytest.raises(ResponseNotFoundError) as err:
        store.get("c", "previous_response_id")
    assert err.value.field == "previous_response_id"
    ResponsesStore(0, 1.0).put("x", StoredResponse({}, []))     # 0 keeps nothing, and says nothing


def test_input_items_as_chat_messages():
    request = ResponsesRequest(input=[
        {"role": "developer", "content": "be brief"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "reasoning", "summary": []}])
    assert chat_messages(request.input_items()) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "ab"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"}]


def test_chat_errors_name_the_responses_fields():
    renamed = responses_field(RequestError.at("response_format", "bad schema"))
    assert (renamed.field, str(renamed)) == ("text.format", "text.format: bad schema")
    renamed = responses_field(RequestError.at("tools[0].function.parameters", "bad"))
    assert renamed.field == "tools[0].parameters"
    with pytest.raises(RequestError) as err:
        ResponsesRequest(input=[{"type": "item_reference", "id": "x"}]).input_items()
    assert err.value.field == "input[0].type"
