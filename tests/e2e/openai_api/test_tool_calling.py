"""Tool calling and reasoning output over HTTP, against real engine-serve processes with a hermes-style
(Qwen2.5-like) chat template that renders tools (tests/data/hermes_tools.jinja).

A random-weight model never calls tools by itself: forced calls (tool_choice required or named) come from the
grammar; `auto` tests force the model's text with a structured_outputs regex, so the server's parser reads a
real call the engine wrote."""
from __future__ import annotations

import json
import re
from typing import Any, Literal

import httpx
import jsonschema
import pytest

from pagedserve.tests.helpers.processes.server import HERMES_TEMPLATE, TOOL_FLAGS, Server
from pagedserve.tests.helpers.models.tiny_models import make_tiny_serving_model

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather for a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Oslo", "Rome"]},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}},
                                       "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
AUTO_CALL = r'Checking\. <tool_call>\n\{"name": "get_weather", "arguments": \{"city": "(Paris|Oslo)", ' \
            r'"unit": "celsius"\}\}\n</tool_call>'


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return make_tiny_serving_model(str(tmp_path_factory.mktemp("tiny_tools")))


@pytest.fixture(scope="module")
def server(model):
    srv = Server(*TOOL_FLAGS, model=model, max_model_len=512)
    yield srv
    srv.stop_and_check_clean()


def chat(server: Server, **fields: Any) -> httpx.Response:
    body = {"messages": MESSAGES, "max_tokens": 120, "temperature": 1.0, **fields}
    return httpx.post(server.url + "/v1/chat/completions", json=body, headers=server.auth, timeout=120)


def streamed(server: Server, **fields: Any) -> tuple[dict[str, Any], str | None, list[dict[str, Any]]]:
    """The stream reassembled: ({content, reasoning_content}, finish_reason, tool calls), checking that each
    call opens with id, type and name before its argument fragments."""
    body = {"messages": MESSAGES, "max_tokens": 120, "temperature": 1.0, "stream": True, **fields}
    text: dict[str, str] = {"content": "", "reasoning_content": ""}
    calls: dict[int, dict[str, Any]] = {}
    reason = None
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.auth,
                      timeout=120) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            choice = json.loads(line[6:])["choices"][0]
            delta = choice["delta"]
            for key in text:
                text[key] += delta.get(key) or ""
            for tc in delta.get("tool_calls", []):
                if tc["index"] not in calls:
                    assert tc["id"].startswith("chatcmpl-tool-") and tc["type"] == "function", tc
                    calls[tc["index"]] = {"name": tc["function"]["name"], "arguments": ""}
                else:
                    assert "name" not in tc["function"], tc
                calls[tc["index"]]["arguments"] += tc["function"]["arguments"]
            reason = choice["finish_reason"] or reason
    return text, reason, [calls[i] for i in sorted(calls)]


def calls_of(message: dict[str, Any]) -> list[dict[str, Any]]:
    for call in message["tool_calls"]:
        assert call["id"].startswith("chatcmpl-tool-") and call["type"] == "function"
    return [{"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in message["tool_calls"]]


def assert_400(resp: httpx.Response, param: str) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and param in err["message"], err
    return err["message"]


@pytest.mark.parametrize("seed", range(4))
def test_named_tool_choice_is_a_valid_call(server, seed):
    choice = {"type": "function", "function": {"name": "get_weather"}}
    resp = chat(server, tools=TOOLS, tool_choice=choice, seed=seed)
    assert resp.status_code == 200, resp.text
    out = resp.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] is None
    [call] = calls_of(out["message"])
    assert call["name"] == "get_weather"
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS["get_weather"])
    # The stream with the same seed reassembles into the same call.
    text, reason, calls = streamed(server, tools=TOOLS, tool_choice=choice, seed=seed)
    assert (text["content"], reason, calls) == ("", "tool_calls", [call])


@pytest.mark.parametrize("seed", range(4))
def test_required_tool_choice_is_valid_calls(server, seed):
    resp = chat(server, tools=TOOLS, tool_choice="required", seed=seed)
    assert resp.status_code == 200, resp.text
    out = resp.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls"
    calls = calls_of(out["message"])
    assert calls
    for call in calls:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    assert streamed(server, tools=TOOLS, tool_choice="required", seed=seed)[1:] == ("tool_calls", calls)


def test_auto_tool_choice_parses_the_models_call(server):
    fields = dict(tools=TOOLS, tool_choice="auto", structured_outputs={"regex": AUTO_CALL}, seed=3)
    resp = chat(server, **fields)
    assert resp.status_code == 200, resp.text
    out = resp.json()["choices"][0]
    assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == "Checking. "
    [call] = calls_of(out["message"])
    assert call["name"] == "get_weather"
    assert json.loads(call["arguments"])["city"] in ("Paris", "Oslo")
    text, reason, calls = streamed(server, **fields)
    assert (text["content"], reason, calls) == ("Checking. ", "tool_calls", [call])


def test_auto_without_a_call_is_plain_content(server):
    resp = chat(server, tools=TOOLS, structured_outputs={"regex": "It is sunny\\."}, seed=0)
    out = resp.json()["choices"][0]
    assert out["finish_reason"] == "stop" and out["message"]["content"] == "It is sunny."
    assert out["message"]["tool_calls"] == []


def test_two_turn_tool_conversation(server):
    first = chat(server, tools=TOOLS, tool_choice="required", seed=1).json()["choices"][0]["message"]
    call = first["tool_calls"][0]
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": first["tool_calls"]},
               {"role": "tool", "tool_call_id": call["id"], "content": "18 degrees and sunny"}]
    resp = chat(server, messages=history, tools=TOOLS, max_tokens=8)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"
    # The template saw the tools, the call with its arguments as an object, and the result.
    tokens = httpx.post(server.url + "/tokenize", json={"messages": history, "tools": TOOLS},
                        headers=server.auth, timeout=60).json()["tokens"]
    rendered = httpx.post(server.url + "/detokenize", json={"tokens": tokens}, headers=server.auth,
                          timeout=60).json()["prompt"]
    args = json.dumps(json.loads(call["function"]["arguments"]), ensure_ascii=False)
    assert f'{{"name": "{call["function"]["name"]}", "arguments": {args}}}' in rendered
    assert "<tool_response>\n18 degrees and sunny\n</tool_response>" in rendered
    assert '"name": "get_time"' in rendered.split("</tools>\nFor each call")[0]


def test_official_client_with_tools(server):
    client = server.client()
    resp = client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, tools=TOOLS,
                                          tool_choice={"type": "function", "function": {"name": "get_time"}},
                                          max_tokens=60, seed=2)
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls" and call.function.name == "get_time"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_time"])


def test_langchain_structured_output_and_bind_tools(server):
    from langchain_openai import ChatOpenAI
    from pydantic import BaseModel, Field

    class Weather(BaseModel):
        """Weather report"""
        city: str = Field(max_length=12)
        rainy: bool

    llm = ChatOpenAI(base_url=server.url + "/v1", api_key=server.api_key, model=server.client().models.list()
                     .data[0].id, max_tokens=80, temperature=0.7, seed=5, max_retries=0)
    report = llm.with_structured_output(Weather, method="function_calling").invoke("Weather in Oslo?")
    assert isinstance(report, Weather)

    def get_time(zone: str) -> str:
        """The time in a zone."""
        return "12:00"

    msg = llm.bind_tools([get_time], tool_choice="get_time").invoke("What time is it?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_time" and isinstance(msg.tool_calls[0]["args"], dict)
    msg = llm.bind_tools([get_time, Weather], tool_choice="any").invoke("Anything")
    assert msg.tool_calls and {c["name"] for c in msg.tool_calls} <= {"get_time", "Weather"}


def test_litellm_tool_call(server):
    """litellm's OpenAI-compatible provider, as its users point it at a vLLM server."""
    import litellm
    resp = litellm.completion(model="openai/" + server.client().models.list().data[0].id, api_base=server.url + "/v1",
                              api_key=server.api_key, messages=MESSAGES, tools=TOOLS, max_tokens=60, seed=3,
                              tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = resp.choices[0].message.tool_calls[0]
    assert resp.choices[0].finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS["get_weather"])


def test_agents_sdk_over_chat_completions(server):
    """The OpenAI Agents SDK with its chat-completions model (the one it uses for non-OpenAI servers): the
    forced call runs the Python tool, whose answer ends the run."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, function_tool, set_tracing_disabled
    set_tracing_disabled(True)
    ran: list[str] = []

    @function_tool       # an enum: a free string would run a random model's argument to max_tokens
    def get_time(zone: Literal["UTC", "CET"]) -> str:
        """The time in a zone."""
        ran.append(zone)
        return f"12:00 {zone}"

    model = OpenAIChatCompletionsModel(model=server.client().models.list().data[0].id,
                                       openai_client=server.async_client())
    agent = Agent(name="clock", instructions="Answer with the tool.", tools=[get_time], model=model,
                  model_settings=ModelSettings(tool_choice="get_time", max_tokens=60, extra_body={"seed": 1}),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "What time is it?"))
    assert len(ran) == 1 and result.final_output == f"12:00 {ran[0]}"


@pytest.mark.parametrize("fields,param", [
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 5}}}]},
     "tools[0].function.parameters"),
    ({"tools": [{"type": "retrieval"}]}, "tools[0]"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": [*MESSAGES, {"role": "assistant", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]},
     "messages[1].tool_calls[0].function.arguments"),
])
def test_bad_tool_requests_are_400(server, fields, param):
    assert_400(chat(server, **fields), param)
    assert chat(server, max_tokens=2).status_code == 200     # and the engine keeps serving


# ---------------------------------------------------------------- reasoning, and a server without auto tools

@pytest.fixture(scope="module")
def thinking_server(model):
    srv = Server("--chat-template", HERMES_TEMPLATE, "--reasoning-parser", "qwen3", model=model, max_model_len=512)
    yield srv
    srv.stop_and_check_clean()


def test_reasoning_content_split_whole_and_streamed(thinking_server):
    # The template closes the thinking in the prompt (enable_thinking=false), so the grammar applies from the
    # first token and can write a thinking block for the parser to split.
    fields = dict(structured_outputs={"regex": "<think>[a-z]{2,10}( [a-z]{2,10}){0,3}</think>\n(Yes|No)\\."},
                  chat_template_kwargs={"enable_thinking": False}, seed=7)
    message = chat(thinking_server, **fields).json()["choices"][0]["message"]
    assert re.fullmatch("[a-z]{2,10}( [a-z]{2,10}){0,3}", message["reasoning_content"]), message
    assert message["content"] in ("\nYes.", "\nNo.")
    text, reason, calls = streamed(thinking_server, **fields)
    assert text == {"content": message["content"], "reasoning_content": message["reasoning_content"]}
    assert reason == "stop" and calls == []


def test_auto_tools_need_the_server_flags(thinking_server):
    message = assert_400(chat(thinking_server, tools=TOOLS), "tools")
    assert "--enable-auto-tool-choice" in message and "--tool-call-parser" in message
    assert_400(chat(thinking_server, tools=TOOLS, tool_choice="auto"), "tool_choice")
    # Forced calls need no flags.
    resp = chat(thinking_server, tools=TOOLS, tool_choice="required", chat_template_kwargs={"enable_thinking": False})
    assert resp.json()["choices"][0]["finish_reason"] == "tool_calls"


# ---------------------------------------------------------------- the other auto parsers, end to end

@pytest.mark.parametrize("parser,regex,content", [
    ("llama3_json", r'<\|python_tag\|>\{"name": "get_time", "parameters": \{"zone": "(UTC|CET)"\}\}; '
                    r'\{"name": "get_weather", "parameters": \{"city": "Rome", "unit": "celsius"\}\}', None),
    ("mistral", r'On it\. \[TOOL_CALLS\]\[\{"name": "get_time", "arguments": \{"zone": "(UTC|CET)"\}\}, '
                r'\{"name": "get_weather", "arguments": \{"city": "Rome", "unit": "celsius"\}\}\]', "On it. "),
])
def test_other_auto_parsers(model, parser, regex, content):
    srv = Server("--chat-template", HERMES_TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", parser,
                 model=model, max_model_len=512)
    try:
        fields = dict(tools=TOOLS, structured_outputs={"regex": regex}, seed=11)
        out = chat(srv, **fields).json()["choices"][0]
        assert out["finish_reason"] == "tool_calls" and out["message"]["content"] == content
        calls = calls_of(out["message"])
        assert [c["name"] for c in calls] == ["get_time", "get_weather"]
        for call in calls:
            jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
        text, reason, streamed_calls = streamed(srv, **fields)
        assert (text["content"] or None, reason, streamed_calls) == (content, "tool_calls", calls)
    finally:
        srv.stop_and_check_clean()
