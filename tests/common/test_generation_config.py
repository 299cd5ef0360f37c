"""The model's generation_config.json (`--generation-config auto|vllm|FOLDER`): its sampling fields are the
defaults of requests that leave them unset (offline and over HTTP; a request's own value wins), and its extra
eos_token_id ends generation. The tiny model's greedy continuation comes from HF transformers (the oracle);
the extra EOS id is a token it greedily emits mid-way, so a run that ignores the file runs past it."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.processes.server import Server
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, make_tiny_model

PROMPT = [5, 6, 7, 8]
TEXT_PROMPT = "w5 w6 w7 w8"       # the synthetic tokenizer: one word per id
LONG = 12
LLM_KW = dict(dtype="float32", max_model_len=64, kv_cache_memory=0.02)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """with_gc: a model whose generation_config.json sets temperature 0, top_k 5 and an extra EOS id (a token
    its greedy run emits at `stop_at`); plain: the same weights with HF's default generation config;
    gc_only: a folder holding just with_gc's generation_config.json."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("gencfg")
    plain = make_tiny_model(str(root / "plain"), tokenizer="synthetic", seed=3, eos_token_id=511)
    [greedy] = hf_greedy(AutoModelForCausalLM.from_pretrained(plain, dtype="float32"), [PROMPT], LONG)
    stop_at = next(i for i in range(2, LONG) if greedy[i] not in greedy[:i])
    with_gc = str(root / "with_gc")
    shutil.copytree(plain, with_gc)
    config = {"bos_token_id": 1, "eos_token_id": [511, greedy[stop_at]], "temperature": 0.0, "top_k": 5}
    with open(os.path.join(with_gc, "generation_config.json"), "w") as f:
        json.dump(config, f)
    gc_only = root / "gc_only"
    gc_only.mkdir()
    shutil.copy(os.path.join(with_gc, "generation_config.json"), gc_only)
    return {"plain": plain, "with_gc": with_gc, "gc_only": str(gc_only), "greedy": greedy, "stop_at": stop_at}


def _stops_at_the_extra_eos(llm: LLM, models: dict) -> None:
    """No sampling params: the file's temperature 0 makes it greedy, and its extra EOS id ends it."""
    want = models["greedy"][: models["stop_at"] + 1]
    defaults = llm.get_default_sampling_params()
    assert (defaults.temperature, defaults.top_k) == (0.0, 0)      # greedy drops top_k itself
    [out] = llm.generate([PROMPT], use_tqdm=False)
    assert out.outputs[0].token_ids == want and out.outputs[0].finish_reason == "stop"
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=LONG), use_tqdm=False)
    assert out.outputs[0].token_ids == want and out.outputs[0].finish_reason == "stop"
    [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=LONG, ignore_eos=True),
                         use_tqdm=False)
    assert out.outputs[0].token_ids == models["greedy"]


def test_auto_reads_the_models_generation_config(models):
    with LLM(models["with_gc"], **LLM_KW) as llm:
        _stops_at_the_extra_eos(llm, models)
        assert llm.info.default_sampling == {"temperature": 0.0, "top_k": 5}


def test_a_folder_supplies_the_generation_config(models):
    with LLM(models["plain"], generation_config=models["gc_only"], **LLM_KW) as llm:
        _stops_at_the_extra_eos(llm, models)


def test_vllm_ignores_the_generation_config(models):
    with LLM(models["with_gc"], generation_config="vllm", **LLM_KW) as llm:
        assert llm.get_default_sampling_params() == SamplingParams()
        assert llm.info.default_sampling == {}
        [out] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=LONG), use_tqdm=False)
        assert out.outputs[0].token_ids == models["greedy"] and out.outputs[0].finish_reason == "length"


def test_bad_generation_config_is_refused_naming_it(models, tmp_path):
    with pytest.raises(ValueError, match="generation_config"):
        LLM(models["plain"], generation_config=str(tmp_path / "missing"), **LLM_KW)
    with pytest.raises(ValueError, match="has no generation_config.json"):
        LLM(models["plain"], generation_config=str(tmp_path), **LLM_KW)
    with open(tmp_path / "generation_config.json", "w") as f:
        json.dump({"temperature": -1}, f)
    with pytest.raises(ValueError, match="temperature must be >= 0"):
        LLM(models["plain"], generation_config=str(tmp_path), **LLM_KW)


def _ids(choice) -> list[int]:
    return [int(t.removeprefix("w")) for t in choice.logprobs.tokens]


def test_http_requests_take_the_defaults_and_their_own_values_win(models):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    server = Server("--kv-cache-memory", "0.02", "--chat-template", template, model=models["with_gc"],
                    max_model_len=64)
    try:
        client = server.client()
        want = models["greedy"][: models["stop_at"] + 1]
        unset = client.completions.create(model="with_gc", prompt=PROMPT, max_tokens=LONG, logprobs=0)
        assert _ids(unset.choices[0]) == want and unset.choices[0].finish_reason == "stop"
        # The request's own temperature wins: hot sampling leaves the greedy path.
        hot = client.completions.create(model="with_gc", prompt=PROMPT, max_tokens=LONG, logprobs=0,
                                        temperature=5.0, n=4, seed=1, extra_body={"top_k": 100})
        assert any(_ids(c) != want for c in hot.choices)
        chats = [client.chat.completions.create(model="with_gc", max_tokens=LONG, **extra,
                                                messages=[{"role": "user", "content": TEXT_PROMPT}])
                 for extra in ({}, {"temperature": 0})]
        assert chats[0].choices[0].message.content == chats[1].choices[0].message.content
        assert chats[0].choices[0].finish_reason == "stop"
        assert chats[0].usage.completion_tokens == len(want)
    finally:
        server.stop()


def test_http_generation_config_vllm_ignores_the_file(models):
    server = Server("--kv-cache-memory", "0.02", "--generation-config", "vllm", model=models["with_gc"],
                    max_model_len=64)
    try:
        out = server.client().completions.create(model="with_gc", prompt=PROMPT, max_tokens=LONG,
                                                 temperature=0, logprobs=0)
        assert _ids(out.choices[0]) == models["greedy"] and out.choices[0].finish_reason == "length"
    finally:
        server.stop()
