"""logit_bias, allowed_token_ids and bad_words: offline (LLM) and over HTTP (engine-serve + the openai
client), on a tiny random Llama with a real tokenizer. Greedy runs of the same model are the reference."""
from __future__ import annotations

import time

import httpx
import openai
import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.ipc.messages import EngineCoreRequest
from pagedserve.tests.helpers.processes.server import Server

PROMPT = "The capital of France is"
VOCAB = 49152
FORCED = 1234


@pytest.fixture(scope="module")
def llm(tiny_serving_model):
    with LLM(tiny_serving_model, dtype="float32", max_model_len=256) as engine:
        yield engine


@pytest.fixture(scope="module")
def server(api_server):
    return api_server


def run(llm: LLM, prompt: str = PROMPT, **params) -> list[int]:
    params.setdefault("temperature", 0)
    params.setdefault("max_tokens", 12)
    return list(llm.generate(prompt, SamplingParams(**params), use_tqdm=False)[0].outputs[0].token_ids)


def contains(seq: list[int], sub: list[int]) -> bool:
    return any(seq[i:i + len(sub)] == sub for i in range(len(seq) - len(sub) + 1))


# ------------------------------------------------------------------------------------------- offline

@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bias_plus_100_forces_the_token_every_step(llm, temperature):
    out = run(llm, temperature=temperature, seed=3, logit_bias={FORCED: 100})
    assert out == [FORCED] * 12


def test_bias_minus_100_bans_the_greedy_token(llm):
    greedy = run(llm)
    banned = greedy[0]
    out = run(llm, logit_bias={banned: -100.0})
    assert out != greedy
    assert banned not in out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_allowed_token_ids_confine_every_output_token(llm, seed):
    allowed = [17, 300, 4242, 40000]
    out = run(llm, temperature=1.0, seed=seed, max_tokens=16, allowed_token_ids=allowed)
    assert len(out) == 16 and set(out) <= set(allowed)
    assert run(llm, allowed_token_ids=[4242]) == [4242] * 12


def test_bad_words_are_never_generated(llm):
    greedy = run(llm)
    tok = llm.get_tokenizer()
    # A two-token word greedy produces, and a single-token one.
    word = tok.decode(greedy[1:3])
    single = tok.decode(greedy[4:5])
    out = run(llm, bad_words=[word, single])
    assert out != greedy
    for w in (word, single):
        for form in (w.lstrip(), " " + w.lstrip()):
            ids = tok.encode(form, add_special_tokens=False)
            assert not contains(out, ids), (form, ids, out)


def test_constrained_rows_leave_the_others_alone(llm):
    prompts = [PROMPT, "Once upon a time", "def main():", "The quick brown fox"]
    alone = [run(llm, p) for p in prompts]
    params = [SamplingParams(temperature=0, max_tokens=12, logit_bias={FORCED: 100}),
              SamplingParams(temperature=0, max_tokens=12),
              SamplingParams(temperature=0, max_tokens=12, allowed_token_ids=[5, 6]),
              SamplingParams(temperature=0, max_tokens=12)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outs]
    assert got[0] == [FORCED] * 12 and set(got[2]) <= {5, 6}
    assert got[1] == alone[1] and got[3] == alone[3]


@pytest.mark.parametrize("params, field", [
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (dict(logit_bias={1: 101}), "logit_bias"),
    (dict(logit_bias={1: -100.5}), "logit_bias"),
    (dict(logit_bias={"7": 1.0}), "logit_bias"),
    (dict(allowed_token_ids=[VOCAB + 5]), "allowed_token_ids"),
    (dict(allowed_token_ids=[]), "allowed_token_ids"),
    (dict(allowed_token_ids=[-1]), "allowed_token_ids"),
    (dict(bad_words=[""]), "bad_words"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
])
def test_invalid_values_name_the_field(llm, params, field):
    with pytest.raises(ValueError, match=rf"^{field}"):
        llm.generate(PROMPT, SamplingParams(max_tokens=2, **params), use_tqdm=False)


@pytest.mark.parametrize("params, field", [
    (SamplingParams(allowed_token_ids=[VOCAB]), "allowed_token_ids"),
    (SamplingParams(logit_bias={VOCAB + 1: 3.0}), "logit_bias"),
    (SamplingParams(bad_words=["hello"]), "bad_words"),                     # never tokenized
    (SamplingParams(_bad_words_token_ids=[[1, VOCAB]]), "bad_words"),
])
def test_the_core_checks_the_same_rules(llm, params, field):
    """A client that skips the frontend's checks meets the same ones in EngineCore.add_request."""
    req = EngineCoreRequest("raw-1", [5, 6, 7], params, time.time(), 0)
    with pytest.raises(ValueError, match=rf"^{field}"):
        llm.engine.add_request(req)


def test_truncate_prompt_tokens_keeps_the_last_k(llm):
    full = llm.generate(PROMPT, SamplingParams(max_tokens=1), use_tqdm=False)[0].prompt_token_ids
    out = llm.generate(PROMPT, SamplingParams(max_tokens=1, truncate_prompt_tokens=3), use_tqdm=False)[0]
    assert list(out.prompt_token_ids) == list(full[-3:])


# ------------------------------------------------------------------------------------------- HTTP

def test_http_logit_bias_forces_and_bans(server, llm):
    client = server.client()
    tok = llm.get_tokenizer()
    resp = client.completions.create(model=server_model(server), prompt=PROMPT, max_tokens=6, temperature=0,
                                     logit_bias={str(FORCED): 100})
    assert resp.choices[0].text == tok.decode([FORCED] * 6)
    greedy = run(llm, max_tokens=6)
    resp = client.chat.completions.create(model=server_model(server), max_tokens=6, temperature=0,
                                          messages=[{"role": "user", "content": "hi"}],
                                          logit_bias={str(FORCED): 100})
    assert resp.choices[0].message.content == tok.decode([FORCED] * 6)
    banned = client.completions.create(model=server_model(server), prompt=PROMPT, max_tokens=6, temperature=0,
                                       logit_bias={str(greedy[0]): -100})
    assert banned.choices[0].text == tok.decode(run(llm, max_tokens=6, logit_bias={greedy[0]: -100}))


def test_http_allowed_token_ids_and_bad_words_match_offline(server, llm):
    client = server.client()
    tok = llm.get_tokenizer()
    allowed = [300, 4242, 40000]
    resp = client.completions.create(model=server_model(server), prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"allowed_token_ids": allowed})
    expected = run(llm, max_tokens=8, allowed_token_ids=allowed)
    assert set(expected) <= set(allowed)
    assert resp.choices[0].text == tok.decode(expected)
    word = tok.decode(run(llm, max_tokens=3)[1:3])
    resp = client.completions.create(model=server_model(server), prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"bad_words": [word]})
    assert resp.choices[0].text == tok.decode(run(llm, max_tokens=8, bad_words=[word]))


@pytest.mark.parametrize("extra, field", [
    ({"logit_bias": {str(VOCAB): 1}}, "logit_bias"),
    ({"logit_bias": {"1": 101}}, "logit_bias"),
    ({"logit_bias": {"one": 1}}, "logit_bias"),
    ({"allowed_token_ids": [VOCAB]}, "allowed_token_ids"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"bad_words": [""]}, "bad_words"),
])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_http_invalid_values_are_400_naming_the_field(server, extra, field, endpoint):
    body = {"max_tokens": 2, **extra}
    if endpoint == "chat":
        body["messages"] = [{"role": "user", "content": "hi"}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = PROMPT
        path = "/v1/completions"
    resp = httpx.post(server.url + path, json=body, headers=server.auth, timeout=60)
    assert resp.status_code == 400, resp.text
    err = resp.json()["error"]
    assert err["param"] == field and err["message"].startswith(field)
    with pytest.raises(openai.BadRequestError):   # the official client sees an ordinary 400
        client = server.client()
        if endpoint == "chat":
            client.chat.completions.create(model=server_model(server), messages=body["messages"], max_tokens=2,
                                           extra_body=extra)
        else:
            client.completions.create(model=server_model(server), prompt=PROMPT, max_tokens=2, extra_body=extra)


def server_model(server: Server) -> str:
    return server.client().models.list().data[0].id


def test_offline_chat_continue_final_message(llm):
    partial = "The capital of France is"
    messages = [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": partial}]
    tok = llm.get_tokenizer()
    out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=2), use_tqdm=False,
                   add_generation_prompt=False, continue_final_message=True)[0]
    assert tok.decode(out.prompt_token_ids).endswith(partial)
    closed = llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, add_generation_prompt=False)[0]
    assert len(closed.prompt_token_ids) > len(out.prompt_token_ids)
    with pytest.raises(ValueError, match="^continue_final_message"):
        llm.chat(messages, SamplingParams(max_tokens=1), use_tqdm=False, continue_final_message=True)
