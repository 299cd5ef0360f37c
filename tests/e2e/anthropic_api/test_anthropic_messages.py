"""The Anthropic Messages API (/v1/messages, /v1/messages/count_tokens) against a real engine-serve, through the
real `anthropic` SDK: whole and streamed messages (the SDK's stream helper and its raw events, in Anthropic's
order), parity with chat completions, stop reasons, the prefix cache in usage, a two-turn tool loop, token
counting, and every refusal in Anthropic's error shape with Anthropic's status.

A random-weight model never calls tools by itself: calls are forced with tool_choice any or tool (the grammar
writes them), as the chat tool tests do. LangChain's ChatAnthropic runs against the same server."""
from __future__ import annotations

import json
from typing import Any

import anthropic
import httpx
import jsonschema
import pytest

from pagedserve.tests.helpers.processes.server import Server

WEATHER_SCHEMA = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"name": "get_weather", "description": "Weather for a city", "input_schema": WEATHER_SCHEMA}
TIME = {"name": "get_time", "input_schema": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                             "required": ["zone"], "additionalProperties": False}}
QUESTION = [{"role": "user", "content": "Is it sunny in Paris?"}]
# Longer than a KV block or two, so that a second request reads it from the prefix cache.
# The SDK's create() no longer takes temperature; the API does.
GREEDY = {"temperature": 0}
SYSTEM = "You are a weather assistant. " * 12


@pytest.fixture(scope="module")
def server(tool_server) -> Server:
    return tool_server


def post(server: Server, path: str, headers: dict[str, str] | None = None, **body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.auth if headers is None else headers, timeout=120)


# ---------------------------------------------------------------- messages, whole and streamed

def test_create_and_stream(client, model):
    msg = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, system="Answer briefly.",
                                 messages=QUESTION, metadata={"user_id": "u1"})
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant" and msg.model == model
    [block] = msg.content
    assert block.type == "text" and block.text
    assert msg.usage.output_tokens <= 8 and msg.usage.input_tokens > 0
    assert msg.stop_reason == ("max_tokens" if msg.usage.output_tokens == 8 else "end_turn")
    assert msg.stop_sequence is None
    # The SDK's stream helper accumulates the events into its message and checks them as it goes.
    with client.messages.stream(model=model, max_tokens=8, extra_body=GREEDY, system="Answer briefly.",
                                messages=QUESTION) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == final.content[0].text == block.text
    assert final.stop_reason == msg.stop_reason and final.usage.output_tokens == msg.usage.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == \
        msg.usage.input_tokens + msg.usage.cache_read_input_tokens
    # The raw events, in Anthropic's order.
    events = list(client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, system="Answer briefly.",
                                         messages=QUESTION, stream=True))
    kinds = [e.type for e in events]
    deltas = kinds.count("content_block_delta")
    assert deltas >= 1 and kinds == ["message_start", "content_block_start", *["content_block_delta"] * deltas,
                                     "content_block_stop", "message_delta", "message_stop"]
    assert events[0].message.content == [] and events[0].message.stop_reason is None
    assert all(e.delta.type == "text_delta" and e.index == 0 for e in events if e.type == "content_block_delta")
    assert events[-2].delta.stop_reason == msg.stop_reason and events[-2].usage.output_tokens == msg.usage.output_tokens


def test_greedy_text_equals_chat(server, client, model):
    chat = post(server, "/v1/chat/completions", messages=[{"role": "system", "content": "Be brief."}, *QUESTION],
                max_tokens=12, temperature=0).json()
    blocks = [{"type": "text", "text": QUESTION[0]["content"]}]
    msg = client.messages.create(model=model, max_tokens=12, extra_body=GREEDY,
                                 system=[{"type": "text", "text": "Be brief."}],
                                 messages=[{"role": "user", "content": blocks}])
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == chat["usage"]["prompt_tokens"]
    # Without --enable-prompt-tokens-details, chat's usage is as it was (tests/e2e/openai_api/test_prompt_tokens_details.py).
    assert set(chat["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}
    counted = client.messages.count_tokens(model=model, system="Be brief.", messages=QUESTION)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"]


def test_stop_sequence(client, model):
    first = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=QUESTION)
    text = first.content[0].text
    stop = text[len(text) // 2:len(text) // 2 + 3].strip() or text[-3:]
    assert stop, text
    msg = client.messages.create(model=model, max_tokens=24, extra_body=GREEDY, messages=QUESTION,
                                 stop_sequences=["never-written-xyz", stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == text[:text.index(stop)]
    with client.messages.stream(model=model, max_tokens=24, extra_body=GREEDY, messages=QUESTION,
                                stop_sequences=[stop]) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "stop_sequence" and final.stop_sequence == stop


def test_prefill_continues_the_assistant_turn(server, client, model):
    chat = post(server, "/v1/chat/completions", max_tokens=6, temperature=0, add_generation_prompt=False,
                continue_final_message=True, messages=[*QUESTION, {"role": "assistant", "content": "Yes, it"}]).json()
    msg = client.messages.create(model=model, max_tokens=6, extra_body=GREEDY,
                                 messages=[*QUESTION, {"role": "assistant", "content": "Yes, it"}])
    assert msg.content[0].text == chat["choices"][0]["message"]["content"]


def test_cache_read_input_tokens(client, model):
    body = dict(model=model, max_tokens=2, extra_body=GREEDY, system=SYSTEM, messages=QUESTION)
    client.messages.create(**body)
    again = client.messages.create(**body)
    total = client.messages.count_tokens(model=model, system=SYSTEM, messages=QUESTION).input_tokens
    assert again.usage.cache_read_input_tokens > 0 and again.usage.cache_creation_input_tokens == 0
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens
    assert final.usage.input_tokens == again.usage.input_tokens


# ---------------------------------------------------------------- tools

def test_two_turn_tool_loop(client, model):
    messages: list[dict[str, Any]] = [{"role": "user", "content": "What is the weather in Paris?"}]
    msg = client.messages.create(model=model, max_tokens=60, messages=messages, tools=[WEATHER, TIME],
                                 tool_choice={"type": "tool", "name": "get_weather"})
    assert msg.stop_reason == "tool_use"
    [call] = msg.content
    assert call.type == "tool_use" and call.id.startswith("toolu_") and call.name == "get_weather"
    jsonschema.validate(call.input, WEATHER_SCHEMA)
    messages += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
                 {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id,
                                               "content": [{"type": "text", "text": "Sunny, 21 C"}]},
                                              {"type": "text", "text": "Thanks. Summarise."}]}]
    # The second turn renders the call and its result (they count), and answers in text.
    before = client.messages.count_tokens(model=model, messages=messages[:1], tools=[WEATHER, TIME]).input_tokens
    after = client.messages.count_tokens(model=model, messages=messages, tools=[WEATHER, TIME]).input_tokens
    assert after > before + 10
    reply = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=messages,
                                   tools=[WEATHER, TIME], tool_choice={"type": "none"})
    assert [b.type for b in reply.content] == ["text"] and reply.stop_reason in ("end_turn", "max_tokens")
    assert reply.usage.input_tokens + reply.usage.cache_read_input_tokens == after


def test_tool_choice_any_streamed(client, model):
    """any: the grammar forces one or more calls; the stream sends each as a tool_use block whose
    input_json_delta pieces join into its input."""
    body = dict(model=model, max_tokens=80, messages=QUESTION, tools=[WEATHER, TIME],
                tool_choice={"type": "any", "disable_parallel_tool_use": True})
    events = list(client.messages.create(**body, stream=True))
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"]
    assert starts[0].content_block.input == {} and starts[0].content_block.id.startswith("toolu_")
    pieces = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert all(e.delta.type == "input_json_delta" for e in events if e.type == "content_block_delta")
    name = starts[0].content_block.name
    jsonschema.validate(json.loads(pieces), {"get_weather": WEATHER, "get_time": TIME}[name]["input_schema"])
    assert events[-2].delta.stop_reason == "tool_use"
    with client.messages.stream(**body) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use" and [b.type for b in final.content] == ["tool_use"]
    assert isinstance(final.content[0].input, dict)


# ---------------------------------------------------------------- errors, in Anthropic's shape

def anthropic_error(resp: httpx.Response, status: int, kind: str, names: str) -> str:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert body["type"] == "error" and set(body) == {"type", "error"}, body
    assert body["error"]["type"] == kind and names in body["error"]["message"], body
    return body["error"]["message"]


BASE = {"max_tokens": 4, "messages": QUESTION}


@pytest.mark.parametrize("fields, names", [
    ({"max_tokens": None}, "max_tokens"),
    ({"max_tokens": 0}, "max_tokens"),
    ({"temperature": 1.5}, "temperature"),
    ({"top_p": -0.1}, "top_p"),
    ({"max_token": 4}, "max_token"),
    ({"messages": [{"role": "system", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "document", "source": {}}]}]}, "messages[0].content[0].type"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]}, "messages[0].content[0].tool_use_id"),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {
        "type": "base64", "media_type": "image/tiff", "data": "AAAA"}}]}]}, "media_type"),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type"),
    ({"tools": [{"name": "f"}]}, "tools[0].input_schema"),
    ({"tools": [{"name": "f", "input_schema": {"type": 3}}], "tool_choice": {"type": "any"}}, "tools[0].input_schema"),
    ({"tool_choice": {"type": "any"}}, "'any' needs tools"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool", "name": "nope"}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "tool"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "sometimes"}}, "tool_choice.type"),
    ({"max_tokens": 4000}, "max_tokens"),
    ({"messages": [{"role": "user", "content": "word " * 600}]}, "maximum context length"),
])
def test_bad_requests(server, model, fields, names):
    body = {"model": model, **BASE, **fields}
    anthropic_error(post(server, "/v1/messages", **{k: v for k, v in body.items() if v is not None}), 400,
                    "invalid_request_error", names)


def test_errors_through_the_sdk(server, client, model):
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(model=model, max_tokens=0, messages=QUESTION)
    assert bad.value.body["error"]["type"] == "invalid_request_error" and "max_tokens" in bad.value.message
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.create(model="claude-nope", max_tokens=4, messages=QUESTION)
    assert missing.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="claude-nope", messages=QUESTION)
    with pytest.raises(anthropic.AuthenticationError) as denied:
        anthropic.Anthropic(base_url=server.url, api_key="wrong", max_retries=0).messages.create(
            model=model, max_tokens=4, messages=QUESTION)
    assert denied.value.body == {"type": "error", "error": {"type": "authentication_error",
                                                            "message": "invalid or missing API key"}}
    with pytest.raises(anthropic.BadRequestError):
        client.messages.count_tokens(model=model, messages=[{"role": "user", "content": [{"type": "video"}]}])


def test_auth_headers_and_shapes(server, model):
    """x-api-key is accepted as Authorization: Bearer is; an undecodable body is a 400; the OpenAI routes
    keep OpenAI's error shape."""
    ok = post(server, "/v1/messages", headers={"x-api-key": server.api_key}, model=model, **BASE)
    assert ok.status_code == 200 and ok.json()["type"] == "message"
    assert post(server, "/v1/messages/count_tokens", headers={"x-api-key": server.api_key}, model=model,
                messages=QUESTION).json()["input_tokens"] > 0
    anthropic_error(post(server, "/v1/messages", headers={"x-api-key": "wrong"}, model=model, **BASE), 401,
                    "authentication_error", "API key")
    anthropic_error(post(server, "/v1/messages", headers={}, model=model, **BASE), 401, "authentication_error",
                    "API key")
    raw = httpx.post(server.url + "/v1/messages", content=b"{not json", timeout=30,
                     headers={**server.auth, "content-type": "application/json"})
    anthropic_error(raw, 400, "invalid_request_error", "")
    huge = {"model": model, "max_tokens": 1, "messages": [{"role": "user", "content": "x" * (9 << 20)}]}
    anthropic_error(post(server, "/v1/messages", **huge), 413, "request_too_large", "exceeds")
    openai_shaped = post(server, "/v1/chat/completions", messages=QUESTION, max_tokens=0)
    assert openai_shaped.status_code == 400 and openai_shaped.json()["error"]["param"] == "max_tokens"
    assert post(server, "/v1/chat/completions", headers={"x-api-key": server.api_key}, messages=QUESTION,
                max_tokens=2).status_code == 200


# ---------------------------------------------------------------- LangChain

def test_langchain_chat_anthropic(server, client, model):
    """LangChain's ChatAnthropic pointed at the server: invoke and stream give the SDK's greedy text, and a
    forced tool comes back as its tool_calls."""
    from langchain_anthropic import ChatAnthropic
    llm = ChatAnthropic(base_url=server.url, api_key=server.api_key, model=model, max_tokens=8, temperature=0,
                        max_retries=0)
    want = client.messages.create(model=model, max_tokens=8, extra_body=GREEDY, messages=QUESTION).content[0].text
    answer = llm.invoke(QUESTION[0]["content"])
    assert answer.content == want and answer.usage_metadata["output_tokens"] <= 8
    assert "".join(chunk.text for chunk in llm.stream(QUESTION[0]["content"])) == want
    caller = ChatAnthropic(base_url=server.url, api_key=server.api_key, model=model, max_tokens=60, max_retries=0)
    reply = caller.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("toolu_")
    jsonschema.validate(call["args"], WEATHER_SCHEMA)
    assert reply.response_metadata["stop_reason"] == "tool_use"
