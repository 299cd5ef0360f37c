"""Structured outputs over HTTP against a real engine-serve (the embedded SmolLM2): response_format,
structured_outputs and guided_* under sampling, the official SDK's parse, LangChain's with_structured_output,
bad specs as 400s that stall nothing, and constrained requests that survive preemption."""
from __future__ import annotations

import asyncio
import json
import re
import threading
import time

import httpx
import jsonschema
import pytest
from pydantic import BaseModel, Field

from pagedserve.tests.helpers.schemas import SCHEMAS
from pagedserve.tests.helpers.processes.server import Server

pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
# Few KV blocks (the least a 512-token request needs is 32) so that concurrent requests get preempted.
KV_BLOCKS = 36


@pytest.fixture(scope="module")
def server():
    srv = Server("--structured-outputs-compile-timeout", "1", "--num-gpu-blocks-override", str(KV_BLOCKS),
                 max_model_len=512)
    yield srv
    srv.stop()


def _chat(server: Server, **body) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "max_tokens": 120, **body}
    return httpx.post(f"{server.url}/v1/chat/completions", headers=server.auth, json=body, timeout=120)


def test_json_schemas_over_http_under_sampling(server):
    client = server.async_client()

    async def one(i: int, schema: dict):
        return await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Example {i} as JSON:"}], temperature=1.0,
            seed=100 + i, max_tokens=120,
            response_format={"type": "json_schema", "json_schema": {"name": f"s{i}", "schema": schema,
                                                                    "strict": True}})

    async def run():
        return await asyncio.gather(*(one(i, s) for i, s in enumerate(SCHEMAS)))

    for schema, resp in zip(SCHEMAS, asyncio.run(run())):
        choice = resp.choices[0]
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), schema)


def test_every_field_spelling(server):
    client = server.client()
    out = client.completions.create(model=MODEL, prompt="Code:", max_tokens=30, temperature=1.0, seed=1,
                                    extra_body={"guided_regex": r"[A-Z]{2}-[0-9]{3}"})
    assert re.fullmatch(r"[A-Z]{2}-[0-9]{3}", out.choices[0].text)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}],
                                         max_tokens=10, extra_body={"guided_choice": ["left", "right"]})
    assert out.choices[0].message.content in ("left", "right") and out.choices[0].finish_reason == "stop"
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Yes?"}],
                                         max_tokens=10, extra_body={"structured_outputs": {"regex": "(yes|no)!"}})
    assert out.choices[0].message.content in ("yes!", "no!")
    out = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=60, temperature=1.0, seed=2,
                                    extra_body={"guided_json": SCHEMAS[1]})
    jsonschema.validate(json.loads(out.choices[0].text), SCHEMAS[1])
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "An id"}],
                                         max_tokens=10, extra_body={"guided_grammar": 'root ::= "id" [0-9] [0-9]'})
    assert re.fullmatch(r"id[0-9]{2}", out.choices[0].message.content)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                         response_format={"type": "text"})
    assert out.choices[0].finish_reason == "length"
    # A stream under a grammar: the pieces join into a valid document.
    stream = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "JSON:"}], max_tokens=80, stream=True, seed=3,
        temperature=1.0, response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[5]}})
    text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    jsonschema.validate(json.loads(text), SCHEMAS[5])


class Person(BaseModel):
    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)
    role: str = Field(json_schema_extra={"enum": ["admin", "guest"]})


def test_official_sdk_parse(server):
    client = server.client()
    resp = client.chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": "Describe a user."}],
                                         response_format=Person, max_tokens=80, temperature=1.0, seed=4)
    parsed = resp.choices[0].message.parsed
    assert isinstance(parsed, Person) and parsed.role in ("admin", "guest")


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI
    llm = ChatOpenAI(base_url=f"{server.url}/v1", api_key=server.api_key, model=MODEL, temperature=1.0,
                     max_tokens=80, seed=5)
    person = llm.with_structured_output(Person, method="json_schema").invoke("Describe a user.")
    assert isinstance(person, Person) and 0 <= person.age <= 120


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format"),
    ({"guided_json": {"type": "object", "properties": {"a": {"minimum": "zero"}}}}, "guided_json"),
    ({"guided_regex": "([a-z]"}, "guided_regex"),
    ({"guided_grammar": "root ::= "}, "guided_grammar"),
    ({"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"response_format": {"type": "xml"}}, "response_format"),
])
@pytest.mark.parametrize("stream", [False, True])
def test_bad_specs_are_400_naming_the_field(server, body, param, stream):
    resp = _chat(server, stream=stream, **body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and error["message"].startswith(param), error


def _slow_regex(parts: int) -> str:
    # xgrammar's compile time grows with each bounded run (about 0.4 s each here): far over the 1 s limit.
    return "".join(f"[a-z]{{1,{500 + i}}}{chr(65 + i)}" for i in range(parts))


def test_compile_timeout_is_a_400_and_stalls_no_stream(server):
    client = server.client()
    gaps: list[float] = []
    result: dict = {}

    def plain_stream():
        last = time.monotonic()
        stream = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=60, stream=True,
                                           temperature=0, extra_body={"ignore_eos": True})
        chunks = []
        for chunk in stream:
            now = time.monotonic()
            gaps.append(now - last)
            last = now
            chunks.append(chunk)
        result["finish"] = chunks[-1].choices[0].finish_reason
        result["tokens"] = len(chunks)

    thread = threading.Thread(target=plain_stream)
    thread.start()
    time.sleep(0.5)
    for stream in (False, True):
        resp = _chat(server, stream=stream, guided_regex=_slow_regex(12) + str(stream))
        assert resp.status_code == 400, resp.text
        assert "did not compile within" in resp.json()["error"]["message"]
        assert resp.json()["error"]["param"] == "guided_regex"
    thread.join(120)
    assert result["finish"] == "length" and result["tokens"] >= 60
    # Tokens kept coming while the grammars compiled (a stalled loop would leave a multi-second gap).
    assert max(gaps[1:]) < 3.0, max(gaps)
    out = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Pick"}],
                                         max_tokens=5, extra_body={"guided_choice": ["fine"]})
    assert out.choices[0].message.content == "fine"


def test_constrained_requests_survive_preemption(server):
    client = server.async_client()
    schema = SCHEMAS[2]
    before = server.metrics().get("num_preemptions_total", 0.0)

    async def one(i: int):
        # Long prompts and ignore_eos neighbours fill the small KV cache, so the scheduler preempts.
        if i % 2:
            return await client.completions.create(model=MODEL, prompt="word " * 120, max_tokens=150,
                                                   temperature=0, extra_body={"ignore_eos": True})
        return await client.completions.create(
            model=MODEL, prompt=f"{'Some context. ' * 30}Tags as JSON {i}:", max_tokens=150, temperature=1.0,
            seed=i, extra_body={"guided_json": schema})

    async def run():
        return await asyncio.gather(*(one(i) for i in range(8)))

    outs = asyncio.run(run())
    assert server.metrics()["num_preemptions_total"] > before
    for i in range(0, 8, 2):
        assert outs[i].choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(outs[i].choices[0].text), schema)
