"""use_beam_search over HTTP (vLLM's extra field): n choices, best first, equal to LLM.beam_search for the same
prompt; combinations it cannot honour are a 400 naming the field; a client that leaves aborts the search and every
KV block returns to the pool. A real engine-serve on a tiny model, with the openai client."""
from __future__ import annotations

import httpx
import openai
import pytest

from pagedserve import LLM, BeamSearchParams
from pagedserve.frontend.beam_search.search import output_text_ids

PROMPT = "The capital of France is"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


@pytest.fixture(scope="module")
def llm(tiny_serving_model):
    with LLM(tiny_serving_model, dtype="float32", max_model_len=256) as llm:     # the api_server's settings
        yield llm


def offline_texts(llm: LLM, prompt: list[int], width: int, max_tokens: int) -> list[tuple[str, str]]:
    out = llm.beam_search([{"prompt_token_ids": prompt}], BeamSearchParams(beam_width=width, max_tokens=max_tokens))
    return [(llm.tokenizer.decode(output_text_ids(s, False)), s.finish_reason) for s in out[0].sequences]


def model_name(client: openai.OpenAI) -> str:
    return client.models.list().data[0].id


def test_completions_beams_equal_llm(server, llm):
    client = server.client()
    resp = client.completions.create(model=model_name(client), prompt=PROMPT, n=3, max_tokens=8,
                                     extra_body={"use_beam_search": True, "length_penalty": 1.0})
    assert [c.index for c in resp.choices] == [0, 1, 2]
    want = offline_texts(llm, llm.tokenizer.encode(PROMPT), 3, 8)
    assert [(c.text, c.finish_reason) for c in resp.choices] == want
    assert resp.usage.completion_tokens == 3 * 8 or any(r == "stop" for _, r in want)


def test_chat_beams_equal_llm(server, llm):
    client = server.client()
    resp = client.chat.completions.create(model=model_name(client), messages=MESSAGES, n=2, max_tokens=6,
                                          extra_body={"use_beam_search": True})
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": MESSAGES}, headers=server.auth,
                     timeout=30).json()["tokens"]
    want = offline_texts(llm, ids, 2, 6)
    assert [(c.message.content, c.finish_reason) for c in resp.choices] == want


@pytest.mark.parametrize("route,fields,param", [
    ("/v1/completions", {"stream": True}, "stream"),
    ("/v1/completions", {"logprobs": 2}, "logprobs"),
    ("/v1/completions", {"n": 30}, "n"),
    ("/v1/chat/completions", {"top_p": 0.5}, "top_p"),
    ("/v1/chat/completions", {"response_format": {"type": "json_object"}}, "response_format"),
])
def test_refused_combinations_name_the_field(server, route, fields, param):
    body = {"prompt": PROMPT} if route == "/v1/completions" else {"messages": MESSAGES}
    resp = httpx.post(server.url + route, headers=server.auth, timeout=30,
                      json={**body, "max_tokens": 4, "n": 2, "use_beam_search": True, **fields})
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_disconnect_aborts_the_search(server):
    before = server.wait_idle()
    try:
        resp = httpx.post(server.url + "/v1/completions", headers=server.auth, timeout=0.5,
                          json={"prompt": PROMPT, "n": 16, "max_tokens": 240, "ignore_eos": True,
                                "use_beam_search": True})
    except httpx.TimeoutException:
        resp = None             # the client left mid-search
    assert resp is None, f"answered before the client left: {resp.status_code} {resp.text[:500]}"
    after = server.wait_idle(timeout_s=60)
    assert after["num_requests_running"] == 0 and after["num_requests_waiting"] == 0, after
    assert after["kv_cache_usage_perc"] == 0, after
    # The whole search generates 1 + 239 * 16 tokens (one per step request), seconds of work; the server sees
    # the client gone within its 0.5 s disconnect poll, far short of that.
    assert after["generation_tokens_total"] - before["generation_tokens_total"] < 16 * 120
