"""lm-evaluation-harness against a real engine-serve: its `local-completions` model scores a multiple-choice
task through /v1/completions (echo + logprobs, prompt logprobs), and every item's loglikelihoods equal those of
lm-eval's own `hf` backend on the same weights, in float32. Offline: local JSON data, a task YAML in the repo."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.slow
TOL = 1e-3
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _run_lm_eval(model: str, model_args: dict, tmp_path, env_extra: dict[str, str] | None = None) -> dict:
    out = tmp_path / f"{model}.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               HF_DATASETS_CACHE=str(tmp_path / "datasets"), HF_HOME=str(tmp_path / "hf_home"),
               **(env_extra or {}))
    proc = subprocess.run([sys.executable, "-m", "pagedserve.tests.helpers.lm_eval_run", model,
                           json.dumps(model_args), str(out)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    with open(out) as f:
        return json.load(f)


def test_local_completions_matches_hf_backend(tiny_serving_model, chunked_prefill_server, tmp_path):
    srv = chunked_prefill_server
    name = srv.client().models.list().data[0].id
    served = _run_lm_eval("local-completions", {
        "model": name, "base_url": f"{srv.url}/v1/completions", "tokenizer_backend": "huggingface",
        "tokenizer": tiny_serving_model, "max_length": 128, "max_retries": 1}, tmp_path,
        {"OPENAI_API_KEY": srv.api_key})
    reference = _run_lm_eval("hf", {"pretrained": tiny_serving_model, "dtype": "float32"}, tmp_path)
    assert len(served["loglikelihoods"]) == len(reference["loglikelihoods"]) == 6
    for item, (ours, theirs) in enumerate(zip(served["loglikelihoods"], reference["loglikelihoods"])):
        assert len(ours) == len(theirs) == 4
        for choice, (a, b) in enumerate(zip(ours, theirs)):
            assert abs(a - b) < TOL, f"item {item} choice {choice}: served {a} vs hf {b}"
    flat = [ll for item in reference["loglikelihoods"] for ll in item]
    assert all(ll < 0 for ll in flat) and len(set(flat)) == len(flat)     # real scores, not a constant
    assert served["acc"] == reference["acc"]
