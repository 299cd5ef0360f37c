"""The OpenAI Responses API (/v1/responses) against real engine-serve processes: the official SDK, whole and
streamed (typed events, in order, numbered), parity with chat completions, a function-call round trip through
previous_response_id, structured output from text.format, the store's bounds, OpenAI-shaped errors, and the
OpenAI Agents SDK running a one-tool agent.

A random-weight model never calls tools by itself: calls are forced with tool_choice required or named (the
grammar writes them), and text.format's schema makes answers end on their own."""
from __future__ import annotations

import asyncio
import json
import time
from typing import Any, Literal

import httpx
import jsonschema
import pytest

from pagedserve.tests.helpers.openai_types import validate_event, validate_response
from pagedserve.tests.helpers.processes.server import SMALL_KV, Server

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]}},
                  "required": ["city"], "additionalProperties": False}
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city",
           "parameters": WEATHER_PARAMS}
CHAT_WEATHER = {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}
ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}, "score": {"type": "integer"}},
          "required": ["answer", "score"], "additionalProperties": False}
ANSWER_FORMAT = {"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}}
QUESTION = "Is it sunny in Paris?"


@pytest.fixture(scope="module")
def server(tool_server) -> Server:
    return tool_server


def post(server: Server, path: str, **body: Any) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.auth, timeout=120)


def assert_error(resp: httpx.Response, status: int, param: str | None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and err["code"] == status and err["message"], err
    return err


def stream_events(server: Server, **body: Any) -> list[dict[str, Any]]:
    """Every event of a streamed response, checked against its SSE `event:` line."""
    events = []
    with httpx.stream("POST", server.url + "/v1/responses", json={**body, "stream": True}, headers=server.auth,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        kind = None
        for line in resp.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                events.append(json.loads(line[6:]))
                assert events[-1]["type"] == kind
                validate_event(events[-1])
    return events


# ---------------------------------------------------------------- the official SDK

def test_sdk_whole_and_streamed(server):
    client = server.client()
    resp = client.responses.create(model=client.models.list().data[0].id, input=QUESTION, max_output_tokens=8,
                                   temperature=0, instructions="Answer briefly.")
    assert resp.id.startswith("resp_") and resp.object == "response" and resp.instructions == "Answer briefly."
    [item] = resp.output
    assert item.type == "message" and item.id.startswith("msg_") and item.role == "assistant"
    assert resp.output_text and item.content[0].text == resp.output_text
    u = resp.usage
    assert u.total_tokens == u.input_tokens + u.output_tokens and u.output_tokens <= 8
    cut = u.output_tokens == 8
    assert resp.status == ("incomplete" if cut else "completed")
    assert (resp.incomplete_details.reason if cut else resp.incomplete_details) == ("max_output_tokens" if cut
                                                                                    else None)
    # The same request streamed: the SDK parses every event; they come in order, numbered from 0.
    events = list(client.responses.create(input=QUESTION, max_output_tokens=8, temperature=0,
                                          instructions="Answer briefly.", stream=True))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    kinds = [e.type for e in events]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 1 and kinds == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        *["response.output_text.delta"] * deltas, "response.output_text.done", "response.content_part.done",
        "response.output_item.done", "response.incomplete" if cut else "response.completed"]
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert text == final.output_text == resp.output_text
    assert final.status == resp.status and final.usage.output_tokens == u.output_tokens
    assert events[0].response.status == "in_progress" and events[0].response.id == final.id


def test_greedy_output_equals_chat(server):
    chat = post(server, "/v1/chat/completions", messages=[{"role": "user", "content": QUESTION}], max_tokens=12,
                temperature=0).json()
    resp = post(server, "/v1/responses", input=[{"role": "user", "content": [{"type": "input_text",
                                                                              "text": QUESTION}]}],
                max_output_tokens=12, temperature=0).json()
    assert resp["output"][0]["content"][0]["text"] == chat["choices"][0]["message"]["content"]
    assert resp["usage"]["input_tokens"] == chat["usage"]["prompt_tokens"]


def test_logprobs_included(server):
    resp = post(server, "/v1/responses", input=QUESTION, max_output_tokens=4, temperature=0, top_logprobs=2,
                include=["message.output_text.logprobs"]).json()
    part = resp["output"][0]["content"][0]
    assert len(part["logprobs"]) == 4 and "".join(lp["token"] for lp in part["logprobs"]) == part["text"]
    assert all(len(lp["top_logprobs"]) == 2 and lp["logprob"] <= 0 for lp in part["logprobs"])
    events = stream_events(server, input=QUESTION, max_output_tokens=4, temperature=0, top_logprobs=2,
                           include=["message.output_text.logprobs"])
    streamed = [lp for e in events if e["type"] == "response.output_text.delta" for lp in e["logprobs"]]
    assert [lp["token"] for lp in streamed] == [lp["token"] for lp in part["logprobs"]]


def test_text_format_json_schema(server):
    client = server.client()
    resp = client.responses.create(input=QUESTION, text=ANSWER_FORMAT, max_output_tokens=60,
                                   extra_body={"seed": 3})
    assert resp.status == "completed"
    jsonschema.validate(json.loads(resp.output_text), ANSWER)
    # The SDK's stream helper accumulates the events into its snapshot and checks them as it goes.
    with client.responses.stream(model=resp.model, input=QUESTION, text=ANSWER_FORMAT, max_output_tokens=60,
                                 extra_body={"seed": 3}) as stream:
        final = stream.get_final_response()
    jsonschema.validate(json.loads(final.output_text), ANSWER)


# ---------------------------------------------------------------- function tools and previous_response_id

def test_function_call_round_trip(server):
    first = post(server, "/v1/responses", input=QUESTION, tools=[WEATHER], tool_choice="required",
                 parallel_tool_calls=False, max_output_tokens=120, seed=1).json()
    [call] = first["output"]
    assert call["type"] == "function_call" and call["id"].startswith("fc_") and call["name"] == "get_weather"
    assert call["call_id"].startswith("call_") and call["status"] == "completed"
    jsonschema.validate(json.loads(call["arguments"]), WEATHER_PARAMS)
    second = post(server, "/v1/responses", previous_response_id=first["id"], tools=[WEATHER], max_output_tokens=4,
                  input=[{"type": "function_call_output", "call_id": call["call_id"], "output": "18 degrees"}])
    assert second.status_code == 200, second.text
    assert second.json()["previous_response_id"] == first["id"]
    # The prompt was the whole conversation: question, the call with its arguments, its output.
    messages = [{"role": "user", "content": QUESTION},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": call["call_id"], "type": "function",
                     "function": {"name": "get_weather", "arguments": call["arguments"]}}]},
                {"role": "tool", "tool_call_id": call["call_id"], "content": "18 degrees"}]
    expected = post(server, "/tokenize", messages=messages, tools=[CHAT_WEATHER]).json()
    assert second.json()["usage"]["input_tokens"] == expected["count"]
    rendered = post(server, "/detokenize", tokens=expected["tokens"]).json()["prompt"]
    assert "<tool_response>\n18 degrees\n</tool_response>" in rendered and '"name": "get_weather"' in rendered


def test_streamed_call_is_argument_events(server):
    choice = {"type": "function", "name": "get_weather"}
    whole = post(server, "/v1/responses", input=QUESTION, tools=[WEATHER], tool_choice=choice,
                 max_output_tokens=120, seed=2).json()
    events = stream_events(server, input=QUESTION, tools=[WEATHER], tool_choice=choice, max_output_tokens=120,
                           seed=2)
    kinds = [e["type"] for e in events]
    assert "response.output_text.delta" not in kinds and kinds[-1] == "response.completed"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    args = "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta")
    [done] = [e for e in events if e["type"] == "response.function_call_arguments.done"]
    [call] = events[-1]["response"]["output"]
    assert args == done["arguments"] == call["arguments"] == whole["output"][0]["arguments"]
    assert json.loads(args)["city"] in ("Paris", "Oslo", "Rome") and call["name"] == "get_weather"
    stored = httpx.get(f"{server.url}/v1/responses/{events[-1]['response']['id']}", headers=server.auth, timeout=60)
    assert stored.json() == events[-1]["response"]        # a streamed response is stored as it ended


# ---------------------------------------------------------------- stored responses and errors

def test_retrieve_cancel_and_not_found(server):
    resp = post(server, "/v1/responses", input=QUESTION, max_output_tokens=2, metadata={"k": "v"}).json()
    got = httpx.get(f"{server.url}/v1/responses/{resp['id']}", headers=server.auth, timeout=60)
    assert got.status_code == 200 and got.json() == resp and resp["metadata"] == {"k": "v"}
    validate_response(resp)
    assert httpx.get(f"{server.url}/v1/responses/{resp['id']}", timeout=60).status_code == 401     # no API key
    err = assert_error(post(server, f"/v1/responses/{resp['id']}/cancel"), 400, "response_id")
    assert err["message"] == "Cannot cancel a synchronous response."
    unstored = post(server, "/v1/responses", input=QUESTION, max_output_tokens=2, store=False).json()
    assert_error(httpx.get(f"{server.url}/v1/responses/{unstored['id']}", headers=server.auth), 404, "response_id")
    err = assert_error(post(server, "/v1/responses", input="hi", previous_response_id="resp_nope"), 404,
                       "previous_response_id")
    assert err["type"] == "invalid_request_error" and "resp_nope" in err["message"]
    assert_error(post(server, "/v1/responses/resp_nope/cancel"), 404, "response_id")


@pytest.mark.parametrize("fields, param", [
    ({"tools": [{"type": "web_search"}]}, "tools"),
    ({"tools": [WEATHER, {"type": "file_search", "vector_store_ids": ["v"]}]}, "tools"),
    ({"background": True}, "background"),
    ({"include": ["file_search_call.results"]}, "include"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
     "input[0].content[0].type"),
    ({"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "nonsense"}}}}, "text.format"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
    ({"max_output_token": 5}, "max_output_token"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{"}]}, "input[0].arguments"),
])
def test_unsupported_fields_are_400(server, fields, param):
    err = assert_error(post(server, "/v1/responses", **{"input": QUESTION, **fields}), 400, param)
    assert param in err["message"]


@pytest.fixture(scope="module")
def small_store_server(tiny_serving_model):
    srv = Server(*SMALL_KV, "--responses-store-max-entries", "2", "--responses-store-ttl", "3",
                 model=tiny_serving_model, max_model_len=256)
    yield srv
    srv.stop_and_check_clean()


def test_store_evicts_least_recently_used_then_expires(small_store_server):
    srv = small_store_server

    def make() -> str:
        return post(srv, "/v1/responses", input=QUESTION, max_output_tokens=1).json()["id"]

    def stored(rid: str) -> bool:
        return httpx.get(f"{srv.url}/v1/responses/{rid}", headers=srv.auth, timeout=60).status_code == 200

    a, b = make(), make()
    assert stored(a)                   # a is now more recently used than b
    c = make()
    assert [stored(r) for r in (b, a, c)] == [False, True, True]
    made = time.monotonic()
    assert post(srv, "/v1/responses", input="more", previous_response_id=c, max_output_tokens=1).status_code == 200
    time.sleep(max(0.0, made + 3.2 - time.monotonic()))      # past the TTL of every response made before
    assert not stored(a) and not stored(c)
    assert_error(post(srv, "/v1/responses", input="x", previous_response_id=c), 404, "previous_response_id")


# ---------------------------------------------------------------- the OpenAI Agents SDK

def test_agents_sdk_one_tool_agent(server):
    from agents import Agent, ModelSettings, Runner, function_tool, set_tracing_disabled
    from agents.models.openai_responses import OpenAIResponsesModel
    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo", "Rome"]) -> str:
        """Weather for a city."""
        ran.append(city)
        return f"sunny in {city}"

    client = server.async_client()
    model = OpenAIResponsesModel(model=server.client().models.list().data[0].id, openai_client=client)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather], model=model,
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=120,
                                               extra_body={"seed": 0}),
                  tool_use_behavior="stop_on_first_tool")
    async def both() -> tuple[Any, Any]:
        whole = await Runner.run(agent, QUESTION)
        run = Runner.run_streamed(agent, QUESTION)          # the same agent over the typed event stream
        kinds = [event.data.type async for event in run.stream_events() if event.type == "raw_response_event"]
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        return whole.final_output, run.final_output

    whole, streamed = asyncio.run(both())
    assert len(ran) == 2 and all(city in ("Paris", "Oslo", "Rome") for city in ran)
    assert (whole, streamed) == (f"sunny in {ran[0]}", f"sunny in {ran[1]}")
