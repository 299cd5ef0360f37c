"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs and completions' echo + logprobs) against HF
transformers' float32 log-softmax, offline and over HTTP with the official openai client."""
from __future__ import annotations

import math

import httpx
import pytest
import torch

from pagedserve import LLM, SamplingParams

TOL = 1e-3
K = 3


def _prompts(n: int, length: int, seed: int, vocab: int = 512) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (length + 7 * i,), generator=gen).tolist() for i in range(n)]


def _hf_logprobs(hf_model, ids: list[int]) -> torch.Tensor:
    """[len(ids) - 1, vocab]: row p is log P(. | ids[:p + 1]), float32."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[:-1]


def _check_against_hf(hf_model, ids: list[int], scored: list, k: int = K) -> None:
    ref = _hf_logprobs(hf_model, ids)
    assert scored[0] is None and len(scored) == len(ids)
    for p, entry in enumerate(scored[1:]):
        target = ids[p + 1]
        row = ref[p]
        assert abs(entry[target].logprob - row[target].item()) < TOL, f"position {p + 1}"
        assert entry[target].rank == int((row > row[target]).sum()) + 1
        top = sorted((tid for tid in entry if tid != target or entry[tid].rank <= k), key=lambda t: entry[t].rank)
        assert top == row.topk(k).indices.tolist()
        for tid in top:
            assert abs(entry[tid].logprob - row[tid].item()) < TOL


@pytest.mark.parametrize("engine_kwargs", [
    {},
    {"max_num_batched_tokens": 16, "max_num_seqs": 4},     # chunked prefill: every prompt in several steps
], ids=["whole", "chunked"])
def test_offline_prompt_logprobs_match_hf(tiny_llama_dir, hf_tiny_llama, engine_kwargs):
    prompts = _prompts(3, 21, seed=engine_kwargs.get("max_num_batched_tokens", 0))
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=128, **engine_kwargs) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=3, prompt_logprobs=K), use_tqdm=False)
        plain = llm.generate([{"prompt_token_ids": prompts[0]}], SamplingParams(temperature=0, max_tokens=3),
                             use_tqdm=False)[0]
    for ids, out in zip(prompts, outs):
        _check_against_hf(hf_tiny_llama, ids, out.prompt_logprobs)
        assert len(out.outputs[0].token_ids) == 3
    assert plain.prompt_logprobs is None
    assert plain.outputs[0].token_ids == outs[0].outputs[0].token_ids


def test_prefix_cache_hit_still_scores_whole_prompt(tiny_llama_dir, hf_tiny_llama):
    """The second run of a prompt would hit the prefix cache; a request for prompt logprobs computes it all."""
    ids = _prompts(1, 40, seed=7)[0]
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=128, block_size=16) as llm:
        warm = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2),
                            use_tqdm=False)[0]
        again = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=2),
                             use_tqdm=False)[0]
        scored = llm.generate([{"prompt_token_ids": ids}],
                              SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=K), use_tqdm=False)[0]
    assert warm.num_cached_tokens == 0 and again.num_cached_tokens == 32    # the cache does hit
    assert scored.num_cached_tokens == 0
    _check_against_hf(hf_tiny_llama, ids, scored.prompt_logprobs)
    assert scored.outputs[0].token_ids == warm.outputs[0].token_ids


def test_preempted_request_reports_each_position_once(tiny_llama_dir, hf_tiny_llama):
    """A preempted request recomputes its prompt from scratch; the positions it already reported are not
    reported again, so the list still has one entry per prompt token."""
    prompts = _prompts(4, 24, seed=11)
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=128, block_size=8, num_gpu_blocks_override=17,
             max_num_batched_tokens=128, max_num_seqs=4) as llm:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prompt_logprobs=1),
                            use_tqdm=False)
        assert llm.engine.scheduler.num_preemptions > 0
    for ids, out in zip(prompts, outs):
        _check_against_hf(hf_tiny_llama, ids, out.prompt_logprobs, k=1)


def test_max_tokens_zero_scores_prompt_only(tiny_llama_dir, hf_tiny_llama):
    ids = _prompts(1, 12, seed=3)[0]
    with LLM(tiny_llama_dir, dtype="float32", max_model_len=64) as llm:
        out = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=0, prompt_logprobs=0, n=2),
                           use_tqdm=False)[0]
    assert [c.token_ids for c in out.outputs] == [[], []]
    assert [c.finish_reason for c in out.outputs] == ["length", "length"]
    _check_against_hf(hf_tiny_llama, ids, out.prompt_logprobs, k=0)


@pytest.mark.parametrize("value", [-1, 21, 1.5, True])
def test_prompt_logprobs_validation(value):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=value).validate()


# ---------------------------------------------------------------- over HTTP

@pytest.fixture(scope="module")
def server(chunked_prefill_server):
    srv = chunked_prefill_server
    srv.model_name = srv.client().models.list().data[0].id
    return srv


@pytest.fixture(scope="module")
def hf_serving(tiny_serving_model):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(tiny_serving_model, dtype=torch.float32).eval()


PROMPT = "The quick brown fox jumps over the lazy dog, and then it naps in the warm afternoon sun."


@pytest.mark.parametrize("max_tokens", [0, 4])
def test_http_echo_logprobs_match_hf(server, hf_serving, tiny_serving_model, max_tokens):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(tiny_serving_model)(PROMPT)["input_ids"]
    assert len(ids) > 16, "the prompt must span several prefill chunks"
    resp = server.client().completions.create(model=server.model_name, prompt=PROMPT, max_tokens=max_tokens,
                                              temperature=0, echo=True, logprobs=2)
    choice = resp.choices[0]
    lp = choice.logprobs
    assert choice.text.startswith(PROMPT) and (max_tokens > 0 or choice.text == PROMPT)
    assert len(lp.tokens) == len(ids) + max_tokens == len(lp.token_logprobs) == len(lp.top_logprobs)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert resp.usage.completion_tokens == max_tokens and resp.usage.prompt_tokens == len(ids)
    assert choice.finish_reason == "length"
    ref = _hf_logprobs(hf_serving, ids)
    for p in range(1, len(ids)):
        assert abs(lp.token_logprobs[p] - ref[p - 1, ids[p]].item()) < TOL
        # The top-2 alternatives, keyed by text: the best one is always there.
        assert len(lp.top_logprobs[p]) in (1, 2)
        assert abs(max(lp.top_logprobs[p].values()) - ref[p - 1].max().item()) < TOL
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    if max_tokens:     # the generated part continues the prompt's logprobs; greedy tokens are the top-1
        for p in range(len(ids), len(lp.tokens)):
            assert math.isclose(lp.token_logprobs[p], max(lp.top_logprobs[p].values()), abs_tol=1e-6)


def test_http_stream_echo_logprobs_equal_whole(server):
    kwargs = dict(model=server.model_name, prompt=PROMPT, max_tokens=3, temperature=0, echo=True, logprobs=1)
    whole = server.client().completions.create(**kwargs).choices[0]
    text, token_lps = "", []
    for chunk in server.client().completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            text += choice.text
            token_lps += choice.logprobs.token_logprobs if choice.logprobs else []
    assert text == whole.text
    assert token_lps[0] is None and whole.logprobs.token_logprobs[0] is None
    assert token_lps[1:] == pytest.approx(whole.logprobs.token_logprobs[1:], abs=1e-6)


def test_http_vllm_prompt_logprobs_field(server, hf_serving, tiny_serving_model):
    from transformers import AutoTokenizer
    ids = AutoTokenizer.from_pretrained(tiny_serving_model)(PROMPT)["input_ids"]
    body = {"model": server.model_name, "prompt": ids, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 1}
    resp = httpx.post(f"{server.url}/v1/completions", json=body, headers=server.auth, timeout=60)
    assert resp.status_code == 200, resp.text
    scored = resp.json()["choices"][0]["prompt_logprobs"]
    ref = _hf_logprobs(hf_serving, ids)
    assert scored[0] is None and len(scored) == len(ids)
    for p in range(1, len(ids)):
        entry = scored[p][str(ids[p])]
        assert abs(entry["logprob"] - ref[p - 1, ids[p]].item()) < TOL
        assert entry["rank"] == int((ref[p - 1] > ref[p - 1, ids[p]]).sum()) + 1


def test_http_chat_prompt_logprobs(server):
    body = {"model": server.model_name, "messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 2,
            "temperature": 0, "prompt_logprobs": 0}
    resp = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=server.auth, timeout=60)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    scored = data["prompt_logprobs"]                       # vLLM puts it at the top level of a chat response
    assert scored[0] is None and len(scored) == data["usage"]["prompt_tokens"]
    assert all(len(entry) == 1 and next(iter(entry.values()))["logprob"] <= 0 for entry in scored[1:])


@pytest.mark.parametrize("body, field", [
    ({"prompt": "hi", "max_tokens": 0}, "max_tokens"),                       # 0 only with echo
    ({"prompt": "hi", "prompt_logprobs": 21}, "prompt_logprobs"),
    ({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}, "max_tokens"),
])
def test_http_bad_values_are_400(server, body, field):
    route = "chat/completions" if "messages" in body else "completions"
    resp = httpx.post(f"{server.url}/v1/{route}", json={"model": server.model_name, **body},
                      headers=server.auth, timeout=30)
    assert resp.status_code == 400, resp.text
    assert field in resp.json()["error"]["message"]
