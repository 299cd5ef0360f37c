"""engine-serve as a real subprocess, driven by the official openai client and raw HTTP."""
from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.processes.server import API_KEY, TOKEN, Server

pytestmark = pytest.mark.slow
PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def server():
    srv = Server()
    yield srv
    srv.stop_and_check_clean()


@pytest.fixture(scope="module")
def offline_reference(smollm2_path):
    with LLM(smollm2_path, dtype="float32", max_model_len=1024) as llm:
        out = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24), use_tqdm=False)[0]
    return out.outputs[0]


def test_completion_matches_offline(server, offline_reference):
    resp = server.client().completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=24,
                                              temperature=0)
    assert resp.choices[0].text == offline_reference.text
    assert resp.usage.completion_tokens == len(offline_reference.token_ids)
    assert resp.usage.prompt_tokens > 0


def test_completion_stream_equals_non_stream(server, offline_reference):
    stream = server.client().completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=24,
                                                temperature=0, stream=True, stream_options={"include_usage": True})
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].text
        if chunk.usage:
            usage = chunk.usage
    assert text == offline_reference.text
    assert usage.completion_tokens == len(offline_reference.token_ids)


def test_chat_stream_and_not(server):
    client = server.client()
    messages = [{"role": "user", "content": "Say hello in French."}]
    full = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20,
                                          temperature=0)
    stream = client.chat.completions.create(model="SmolLM2-135M-Instruct", messages=messages, max_tokens=20,
                                            temperature=0, stream=True)
    streamed = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    assert full.choices[0].message.content == streamed
    assert full.choices[0].message.role == "assistant"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens


@pytest.mark.parametrize("prompt", ["Party time 🎉🎉🎉", "Chinese: 你好，世界！我爱"])
def test_stream_never_splits_a_multibyte_character(server, prompt):
    """SmolLM2 continues these with emoji / CJK whose bytes span several tokens (see test_detokenizer.py)."""
    client = server.client()
    kwargs = dict(model="SmolLM2-135M-Instruct", prompt=prompt, max_tokens=12, temperature=0)
    full = client.completions.create(logprobs=0, **kwargs).choices[0]
    assert sum("\ufffd" in t for t in full.logprobs.tokens) >= 2, "the model emitted no split character"
    deltas = [c.choices[0].text for c in client.completions.create(stream=True, **kwargs) if c.choices]
    assert not any("\ufffd" in d for d in deltas), deltas
    assert "".join(deltas) == full.text and "\ufffd" not in full.text


def test_n2_logprobs_and_stop_strings(server, offline_reference):
    client = server.client()
    resp = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=8, n=2,
                                     temperature=0.9, seed=1, logprobs=3)
    assert sorted(c.index for c in resp.choices) == [0, 1]
    lp = resp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) and all(len(t) <= 3 for t in lp.top_logprobs)
    assert resp.usage.completion_tokens == sum(len(c.logprobs.tokens) for c in resp.choices)
    # A stop string taken from the greedy text: cut there, in full and in streamed output.
    words = offline_reference.text.split()
    stop = words[min(3, len(words) - 1)]
    full = client.completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=24, temperature=0,
                                     stop=[stop])
    assert stop not in full.choices[0].text and full.choices[0].finish_reason == "stop"
    assert offline_reference.text.startswith(full.choices[0].text)
    chunks = [c.choices[0].text for c in client.completions.create(
        model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop], stream=True)
        if c.choices]
    assert "".join(chunks) == full.choices[0].text
    assert all(stop not in c for c in chunks)


def test_32_concurrent_streams(server):
    async def one(client, i):
        stream = await client.completions.create(model="SmolLM2-135M-Instruct", prompt=f"Story {i}:",
                                                 max_tokens=10 + i % 5, temperature=0.7, seed=i, stream=True,
                                                 stream_options={"include_usage": True},
                                                 extra_body={"ignore_eos": True})
        pieces, usage = 0, None
        async for chunk in stream:
            pieces += 1
            usage = chunk.usage or usage
        return usage

    async def main():
        client = server.async_client()
        return await asyncio.gather(*(one(client, i) for i in range(32)))

    with pytest.raises(openai.BadRequestError):   # ignore_eos is an extra field: only via extra_body
        server.client().completions.create(model="SmolLM2-135M-Instruct", prompt="x", max_tokens=2,
                                           extra_body={"no_such_field": 1})
    usages = asyncio.run(main())
    assert [u.completion_tokens for u in usages] == [10 + i % 5 for i in range(32)]


def test_disconnect_aborts_request(server):
    with httpx.stream("POST", f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"prompt": "Count:", "max_tokens": 900, "ignore_eos": True, "stream": True},
                      timeout=60) as resp:
        for i, _ in enumerate(resp.iter_lines()):
            if i > 3:
                break
    deadline = time.monotonic() + 10
    while server.metric("num_requests_running") != 0:
        assert time.monotonic() < deadline, "aborted request still running"
        time.sleep(0.2)


@pytest.mark.parametrize("body,status,param", [
    ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ({"prompt": "x", "temperature": -0.5}, 400, "temperature"),
    ({"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ({"prompt": "x " * 1100, "max_tokens": 4}, 400, "prompt"),
    ({"prompt": "x", "model": "nope"}, 404, "model"),
    ({"prompt": "x", "bogus": 1}, 400, "bogus"),
])
def test_bad_input(server, body, status, param):
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers={"Authorization": f"Bearer {API_KEY}"})
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert err["message"] and err["type"] and err["code"] == status
    assert err["param"] == param, err       # the field the rule named, carried as data
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_agent_loop_second_turn_with_the_models_own_template(server):
    """SmolLM2's own template knows no tools: the assistant's tool-calling turn (content null) renders as ""
    (as vLLM renders it), so the turn with the tool's result goes through."""
    call = {"id": "call-1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    messages = [{"role": "user", "content": "What is the weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "tool_call_id": "call-1", "content": "18 degrees and sunny"}]
    resp = httpx.post(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"messages": messages, "max_tokens": 8, "temperature": 0}, timeout=60)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["role"] == "assistant"


def test_malformed_json_and_auth(server):
    auth = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    resp = httpx.post(f"{server.url}/v1/completions", content=b"{not json", headers=auth)
    assert resp.status_code == 400 and "error" in resp.json()
    assert httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}).status_code == 401
    wrong = httpx.post(f"{server.url}/v1/completions", json={"prompt": "x"}, headers={"Authorization": "Bearer no"})
    assert wrong.status_code == 401 and wrong.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{server.url}/v1/models", headers=auth).json()["data"][0]["id"] == "SmolLM2-135M-Instruct"
    big = httpx.post(f"{server.url}/v1/completions", content=b"x" * (9 << 20), headers=auth)
    assert big.status_code == 413


CONNECT_SCRIPT = """
import asyncio, json, sys
from pagedserve import SamplingParams
from pagedserve.frontend.client.async_client import AsyncEngineClient
async def main():
    client = await AsyncEngineClient.connect(sys.argv[1], token=sys.argv[2])
    final = None
    async for out in client.generate(sys.argv[3], SamplingParams(temperature=0, max_tokens=24)):
        final = out
    print(json.dumps(final.outputs[0].token_ids))
    client.client.close()
asyncio.run(main())
"""


def test_connect_from_other_process(server, offline_reference):
    client = server.client()
    busy = subprocess.Popen([sys.executable, "-c", CONNECT_SCRIPT, f"tcp://127.0.0.1:{server.engine_port}", TOKEN,
                             PROMPT], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    for _ in range(3):       # HTTP traffic while the other client runs
        client.completions.create(model="SmolLM2-135M-Instruct", prompt="Hi", max_tokens=8)
    out, err = busy.communicate(timeout=120)
    assert busy.returncode == 0, err[-2000:]
    assert json.loads(out.strip().splitlines()[-1]) == offline_reference.token_ids


def test_wrong_engine_token_is_rejected(server):
    script = CONNECT_SCRIPT.replace("AsyncEngineClient.connect(sys.argv[1], token=sys.argv[2])",
                                    "AsyncEngineClient.connect(sys.argv[1], token=sys.argv[2], timeout_s=3)")
    proc = subprocess.run([sys.executable, "-c", script, f"tcp://127.0.0.1:{server.engine_port}", "wrong", "x"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0 and "TimeoutError" in proc.stderr


def test_api_process_never_loads_torch(server):
    """The API process tokenizes, detokenizes and serves HTTP: torch lives only in the engine core and its
    workers (the frontend learns everything it needs from the core's handshake)."""
    resp = server.client().completions.create(model="SmolLM2-135M-Instruct", prompt=PROMPT, max_tokens=4)
    assert resp.choices[0].text
    with open(f"/proc/{server.proc.pid}/maps") as f:
        api_maps = f.read()
    with open(f"/proc/{server.child('ps-engine-core').pid}/maps") as f:
        core_maps = f.read()
    assert "libtorch" in core_maps          # the check can fail: the core does map it
    assert "libtorch" not in api_maps
