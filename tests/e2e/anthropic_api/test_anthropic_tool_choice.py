"""tool_choice over the Anthropic Messages API (/v1/messages), each of its four kinds through the real `anthropic`
SDK, whole and streamed, against one engine-serve with `--tool-call-parser llama3_json`:

- `any` and `tool` force tool_use blocks through the grammar chat uses for tool_choice required and named;
- `auto` leaves the model free and the server's tool parser decides: a random-weight model writes no call by
  itself, so the model's text is forced with `output_config.format` (a JSON Schema) to be a llama3_json call,
  which the parser then reads into a tool_use block;
- `none` with the same forced text gives that text back as a text block: no parser, no tool_use.

Every answer is also compared with what /v1/chat/completions says to the same request."""
from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from pagedserve.tests.helpers.processes.server import HERMES_TEMPLATE, SMALL_KV, Server

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
                  "required": ["city"], "additionalProperties": False}
TIME_SCHEMA = {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
               "required": ["zone"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}
TIME = {"name": "get_time", "input_schema": TIME_SCHEMA}
SCHEMAS = {"get_weather": WEATHER_SCHEMA, "get_time": TIME_SCHEMA}
QUESTION = [{"role": "user", "content": "Is it sunny in Paris?"}]
# The model's whole answer as llama3_json writes a call: {"name": ..., "parameters": {...}}.
CALL_TEXT = {"type": "json_schema", "schema": {
    "type": "object", "properties": {"name": {"type": "string", "enum": ["get_weather"]}, "parameters": WEATHER_SCHEMA},
    "required": ["name", "parameters"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def server(tiny_serving_model):
    srv = Server(*SMALL_KV, "--chat-template", HERMES_TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser",
                 "llama3_json", model=tiny_serving_model, max_model_len=512)
    yield srv
    srv.stop_and_check_clean()


def create(client: anthropic.Anthropic, model: str, **fields: Any) -> Any:
    """A message (of up to 48 tokens unless told) about the weather, with both tools offered."""
    return client.messages.create(**{"model": model, "max_tokens": 48, "messages": QUESTION,
                                     "tools": [WEATHER, TIME], **fields})


def streamed(client: anthropic.Anthropic, model: str, **fields: Any) -> tuple[list[tuple[str, Any]], str]:
    """The raw event stream reassembled: [(block type, its text or its input)], and the stop reason."""
    blocks: list[list[Any]] = []
    reason = None
    for event in create(client, model, stream=True, **fields):
        if event.type == "content_block_start":
            block = event.content_block
            blocks.append([block.type, block, ""])
            if block.type == "tool_use":
                assert block.id.startswith("toolu_") and block.input == {}
        elif event.type == "content_block_delta":
            assert event.index == len(blocks) - 1
            kind = blocks[-1][0]
            assert event.delta.type == ("input_json_delta" if kind == "tool_use" else "text_delta")
            blocks[-1][2] += event.delta.partial_json if kind == "tool_use" else event.delta.text
        elif event.type == "message_delta":
            reason = event.delta.stop_reason
    return [(kind, (block.name, json.loads(text)) if kind == "tool_use" else text)
            for kind, block, text in blocks], reason


def chat(server: Server, **fields: Any) -> dict[str, Any]:
    tools = [{"type": "function", "function": {"name": t["name"], "parameters": t["input_schema"],
                                               **({"description": t["description"]} if "description" in t else {})}}
             for t in (WEATHER, TIME)]
    body = {"messages": QUESTION, "max_tokens": 48, "tools": tools, **fields}
    resp = httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.auth, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]


def test_any_forces_one_or_more_calls(client, model):
    msg = create(client, model, tool_choice={"type": "any"}, extra_body={"temperature": 1.0})
    assert msg.stop_reason == "tool_use" and msg.content
    assert all(b.type == "tool_use" and b.id.startswith("toolu_") for b in msg.content)
    for block in msg.content:
        jsonschema.validate(block.input, SCHEMAS[block.name])
    assert len({b.id for b in msg.content}) == len(msg.content)
    blocks, reason = streamed(client, model, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert reason == "tool_use" and [kind for kind, _ in blocks] == ["tool_use"]
    name, given = blocks[0][1]
    jsonschema.validate(given, SCHEMAS[name])


def test_tool_forces_that_tool(client, model):
    choice = {"type": "tool", "name": "get_time"}
    msg = create(client, model, tool_choice=choice, extra_body={"temperature": 1.0})
    [call] = msg.content
    assert msg.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_time"
    jsonschema.validate(call.input, TIME_SCHEMA)
    blocks, reason = streamed(client, model, tool_choice=choice, extra_body={"temperature": 0})
    whole = create(client, model, tool_choice=choice, extra_body={"temperature": 0})
    assert (blocks, reason) == ([("tool_use", ("get_time", whole.content[0].input))], "tool_use")


def test_auto_the_parser_reads_the_models_call(server, client, model):
    fields = {"tool_choice": {"type": "auto"}, "extra_body": {"temperature": 0, "output_config": {"format": CALL_TEXT}}}
    msg = create(client, model, **fields)
    [call] = msg.content
    assert msg.stop_reason == "tool_use" and call.type == "tool_use" and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    assert streamed(client, model, **fields) == ([("tool_use", ("get_weather", call.input))], "tool_use")
    # Chat's auto, with the same forced text, reads the same call.
    same = chat(server, tool_choice="auto", temperature=0,
                response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": CALL_TEXT["schema"]}})
    [chat_call] = same["message"]["tool_calls"]
    assert same["finish_reason"] == "tool_calls" and chat_call["function"]["name"] == "get_weather"
    assert json.loads(chat_call["function"]["arguments"]) == call.input


def test_auto_without_a_call_is_text(server, client, model):
    """Left free, the random model writes text: the parser finds no call, as chat's finds none."""
    msg = create(client, model, max_tokens=12, tool_choice={"type": "auto"}, extra_body={"temperature": 0})
    assert [b.type for b in msg.content] == ["text"] and msg.stop_reason in ("end_turn", "max_tokens")
    same = chat(server, max_tokens=12, tool_choice="auto", temperature=0)
    assert same["message"]["tool_calls"] == [] and same["message"]["content"] == msg.content[0].text
    # No tool_choice with tools is auto, as Anthropic's default.
    assert create(client, model, max_tokens=12, extra_body={"temperature": 0}).content[0].text == msg.content[0].text


def test_none_never_calls_even_when_the_text_is_a_call(client, model):
    fields = {"tool_choice": {"type": "none"}, "extra_body": {"temperature": 0, "output_config": {"format": CALL_TEXT}}}
    msg = create(client, model, **fields)
    [block] = msg.content
    assert block.type == "text" and msg.stop_reason == "end_turn"
    written = json.loads(block.text)          # the very call auto would have made, left as text
    assert written["name"] == "get_weather"
    jsonschema.validate(written["parameters"], WEATHER_SCHEMA)
    assert streamed(client, model, **fields) == ([("text", block.text)], "end_turn")


def test_a_forced_call_and_an_output_format_are_refused(client, model):
    with pytest.raises(anthropic.BadRequestError) as bad:
        create(client, model, tool_choice={"type": "any"}, extra_body={"output_config": {"format": CALL_TEXT}})
    assert bad.value.body["error"]["type"] == "invalid_request_error"
    assert "output_config.format" in bad.value.message
