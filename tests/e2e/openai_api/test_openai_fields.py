"""The whole OpenAI request schema over HTTP: metadata fields are accepted and change nothing, fields that
cannot be honoured are a 400 naming them, a misspelt field gets a hint, and vLLM's
continue_final_message / truncate_prompt_tokens do what they say. A real engine-serve on a tiny model."""
from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest

from pagedserve.tests.helpers.processes.server import Server

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "The capital of France is"

METADATA = {"user": "u-1", "store": False, "metadata": {"team": "a"}, "service_tier": "auto",
            "prompt_cache_key": "k-1", "safety_identifier": "s-1", "prompt_cache_retention": "in_memory"}
CHAT_NO_OPS = {**METADATA, "parallel_tool_calls": False, "modalities": ["text"], "tool_choice": "none",
               "response_format": {"type": "text"}, "prediction": {"type": "content", "content": "Paris"},
               "reasoning_effort": "low", "function_call": "none",
               "stream_options": {"include_usage": True, "include_obfuscation": False}}


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def post(server: Server, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=server.auth, timeout=60)


def chat(server: Server, **fields: Any) -> httpx.Response:
    return post(server, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 8, "temperature": 0, **fields})


def completion(server: Server, **fields: Any) -> httpx.Response:
    return post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, **fields})


def assert_400(resp: httpx.Response, param: str) -> str:
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == param and param in err["message"], err
    return err["message"]


def test_metadata_fields_are_accepted_and_change_nothing(server):
    plain = chat(server).json()["choices"][0]["message"]["content"]
    for name, value in CHAT_NO_OPS.items():
        extra = {"stream": True} if name == "stream_options" else {}
        resp = chat(server, **{name: value}, **extra)
        assert resp.status_code == 200, (name, resp.text)
        if not extra:
            assert resp.json()["choices"][0]["message"]["content"] == plain, name
    resp = chat(server, **{k: v for k, v in CHAT_NO_OPS.items() if k != "stream_options"})
    assert resp.json()["choices"][0]["message"]["content"] == plain
    text = completion(server).json()["choices"][0]["text"]
    resp = completion(server, **METADATA, best_of=1)
    assert resp.status_code == 200 and resp.json()["choices"][0]["text"] == text


def test_null_means_the_default_where_openai_allows_it(server):
    plain = chat(server).json()["choices"][0]["message"]["content"]
    resp = chat(server, n=None, presence_penalty=None, frequency_penalty=None, stream=None, logprobs=None)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"] == plain
    resp = completion(server, n=None, echo=None, logprobs=None, stream=None)
    assert resp.status_code == 200, resp.text


def test_the_official_client_sends_metadata_fields(server):
    client = server.client()
    model = client.models.list().data[0].id
    plain = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    tagged = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0,
                                            user="u", store=False, metadata={"a": "b"}, service_tier="auto",
                                            prompt_cache_key="p", safety_identifier="s", parallel_tool_calls=False)
    assert tagged.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("part, param", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}, "messages[0].content[1].type"),
    ({"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}, "messages[0].content[1].type"),
    ({"type": "file", "file": {"file_id": "f"}}, "messages[0].content[1].type"),
])
def test_non_text_content_parts_are_refused(server, part, param):
    messages = [{"role": "user", "content": [{"type": "text", "text": "Describe this"}, part]}]
    message = assert_400(post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 4}), param)
    assert part["type"] in message
    # /tokenize renders the same way: no silent drop there either.
    assert_400(post(server, "/tokenize", {"messages": messages}), param)


@pytest.mark.parametrize("fields, param", [
    ({"audio": {"voice": "alloy", "format": "wav"}, "modalities": ["text", "audio"]}, "audio"),
    ({"modalities": ["text", "audio"]}, "modalities"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"functions": [{"name": "f"}]}, "functions"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"web_search_options": {}}, "web_search_options"),
    ({"verbosity": "low"}, "verbosity"),
    ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"continue_final_message": True}, "continue_final_message"),     # with add_generation_prompt's default
])
def test_chat_fields_that_cannot_be_honoured_are_400(server, fields, param):
    assert_400(chat(server, **fields), param)


@pytest.mark.parametrize("fields, param", [
    ({"suffix": " and that is all."}, "suffix"),
    ({"best_of": 2}, "best_of"),
    ({"best_of": 3, "n": 2}, "best_of"),
])
def test_completion_fields_that_cannot_be_honoured_are_400(server, fields, param):
    assert_400(completion(server, **fields), param)


def test_audio_output_through_the_official_client_is_a_400(server):
    client = server.client()
    with pytest.raises(openai.BadRequestError, match="audio"):
        client.chat.completions.create(model=client.models.list().data[0].id, messages=MESSAGES, max_tokens=4,
                                       modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"})


@pytest.mark.parametrize("send", [chat, completion])
def test_a_misspelt_field_points_to_the_right_one(server, send):
    message = assert_400(send(server, max_token=5), "max_token")
    assert "did you mean max_tokens?" in message
    message = assert_400(send(server, zzz_unheard_of=1), "zzz_unheard_of")
    assert "did you mean" not in message
    message = assert_400(send(server, stream=True, stream_options={"include_usag": True}), "stream_options")
    assert "include_usage" in message


def test_continue_final_message_continues_the_assistant_text(server):
    partial = "The capital of France is"
    messages = MESSAGES + [{"role": "assistant", "content": partial}]
    tokens = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False,
                                        "continue_final_message": True}).json()["tokens"]
    closed = post(server, "/tokenize", {"messages": messages, "add_generation_prompt": False}).json()["tokens"]
    text = post(server, "/detokenize", {"tokens": tokens}).json()["prompt"]
    assert text.endswith(partial)                 # no end-of-turn after the partial answer
    assert len(closed) > len(tokens) and closed[:len(tokens)] == tokens
    resp = chat(server, messages=messages, add_generation_prompt=False, continue_final_message=True)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == len(tokens)


@pytest.mark.parametrize("k", [1, 4])
def test_truncate_prompt_tokens_keeps_the_last_k(server, k):
    long_prompt = "one two three four five six seven eight nine ten " * 3
    resp = completion(server, prompt=long_prompt, truncate_prompt_tokens=k)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == k
    resp = chat(server, truncate_prompt_tokens=k)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["prompt_tokens"] == k
    # -1 means max_model_len: a prompt shorter than that is untouched.
    full = completion(server, prompt=long_prompt).json()["usage"]["prompt_tokens"]
    assert completion(server, prompt=long_prompt, truncate_prompt_tokens=-1).json()["usage"]["prompt_tokens"] == full


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_continuous_usage_stats_put_each_choices_usage_on_its_chunks(server, route):
    """vLLM's stream_options.continuous_usage_stats: every chunk with a choice carries that choice's usage so
    far; the last chunk still carries the whole request's."""
    import json
    body = {"model": server.client().models.list().data[0].id, "max_tokens": 6, "n": 2, "temperature": 0.9,
            "seed": 1, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True}}
    body |= {"messages": MESSAGES} if "chat" in route else {"prompt": PROMPT}
    with httpx.stream("POST", server.url + route, json=body, headers=server.auth, timeout=60) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    seen: dict[int, int] = {}
    prompt_tokens = chunks[-1]["usage"]["prompt_tokens"]
    for chunk in chunks[:-1]:
        if not chunk["choices"]:
            continue
        [choice], u = chunk["choices"], chunk["usage"]
        made = u["completion_tokens"]
        assert made >= seen.get(choice["index"], 0) and u["prompt_tokens"] == prompt_tokens
        assert u["total_tokens"] == prompt_tokens + made
        seen[choice["index"]] = made
    assert seen == {0: 6, 1: 6} and chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 12
    plain = {**body, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", server.url + route, json=plain, headers=server.auth, timeout=60) as r:
        lines = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert all("usage" not in c or c["usage"] is None for c in lines[:-1]) and lines[-1]["usage"]
