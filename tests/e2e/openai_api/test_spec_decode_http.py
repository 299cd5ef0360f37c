"""engine-serve --speculative-config, through the official openai client: the greedy answer of the embedded model
is the offline engine's without speculation, streamed or not, and /metrics counts drafts with vLLM's names."""
from __future__ import annotations

import json

import pytest

from pagedserve import LLM, SamplingParams
from pagedserve.tests.helpers.processes.server import Server

SPEC = {"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4, "prompt_lookup_min": 2}
MESSAGES = [{"role": "user", "content": "Repeat this list exactly: apples, pears, plums, apples, pears, figs, "
                                        "apples, pears, plums, cherries, apples, pears, plums."}]


@pytest.fixture(scope="module")
def server():
    srv = Server("--speculative-config", json.dumps(SPEC), dtype=None)
    yield srv
    srv.stop_and_check_clean()


@pytest.mark.slow
def test_greedy_answer_over_http_equals_the_offline_one_without_drafts(server, smollm2_path):
    with LLM(smollm2_path, max_model_len=1024) as llm:
        want = llm.chat([MESSAGES], SamplingParams(temperature=0.0, max_tokens=80), use_tqdm=False)[0].outputs[0].text
    client = server.client()
    model = client.models.list().data[0].id
    got = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.0, max_tokens=80)
    assert got.choices[0].message.content == want
    stream = client.chat.completions.create(model=model, messages=MESSAGES, temperature=0.0, max_tokens=80,
                                            stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want
    metrics = server.metrics()
    assert metrics["spec_decode_num_drafts_total"] > 0
    assert 0 < metrics["spec_decode_num_accepted_tokens_total"] <= metrics["spec_decode_num_draft_tokens_total"]
    assert metrics["spec_decode_num_accepted_tokens_per_pos_total"] == metrics["spec_decode_num_accepted_tokens_total"]
