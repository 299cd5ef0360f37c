"""Model ids from the Hugging Face Hub, resolved offline from a real hub cache layout (blobs, snapshots, refs):
LLM("org/name") and `engine-serve org/name` load the snapshot `--revision` names, `--download-dir` and HF_HOME
pick the cache, a local folder of the same spelling wins, and an unknown id fails in one line.

huggingface_hub reads HF_* variables when it is imported, so every run here is a fresh process with its own
environment. Nothing touches the network: HF_HUB_OFFLINE=1 throughout."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import httpx
import pytest

from pagedserve.common.model.hub import looks_like_hub_id
from pagedserve.tests.helpers.models.hub_cache import HF_ENV, add_snapshot, commit_hash, offline_env
from pagedserve.tests.helpers.processes.server import Server
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, make_tiny_model

REPO = "org/tiny"
PROMPTS = [[5, 6, 7, 8], [40, 41, 42]]
MAX_TOKENS = 8

# Runs LLM(...) for each job (kwargs) and prints one JSON line per job: its greedy ids, or its error.
_SCRIPT = r"""
import json, sys
from pagedserve import LLM, SamplingParams
for job in json.loads(sys.argv[1]):
    try:
        llm = LLM(**job, dtype="float32", max_model_len=64, kv_cache_memory=0.02)
    except ValueError as exc:
        print(json.dumps({"error": str(exc)}), flush=True)
        continue
    outs = llm.generate(json.loads(sys.argv[2]), SamplingParams(temperature=0, max_tokens=int(sys.argv[3])),
                        use_tqdm=False)
    print(json.dumps({"ids": [o.outputs[0].token_ids for o in outs], "name": llm.info.served_model_name,
                      "path": llm.info.model_path, "tokenizer": llm.info.tokenizer}), flush=True)
    llm.shutdown()
"""


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    """Two tiny models (different weights), their HF greedy continuations, and a hub cache holding the first
    as `main` and the second as `other`; a third snapshot `tok` is a tokenizer-only revision."""
    from transformers import AutoModelForCausalLM
    root = tmp_path_factory.mktemp("hub")
    folders = [make_tiny_model(str(root / f"m{i}"), tokenizer="synthetic", seed=i, eos_token_id=511)
               for i in range(2)]
    expected = [hf_greedy(AutoModelForCausalLM.from_pretrained(f, dtype="float32"), PROMPTS, MAX_TOKENS)
                for f in folders]
    assert expected[0] != expected[1]          # so that loading the wrong snapshot shows
    cache = str(root / "cache")
    add_snapshot(cache, REPO, folders[0], "main")
    add_snapshot(cache, REPO, folders[1], "other")
    tok_only = root / "tok"
    tok_only.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(folders[0], name), tok_only / name)
    add_snapshot(cache, REPO, str(tok_only), "tok")
    return {"root": root, "folders": folders, "expected": expected, "cache": cache}


def run_llm(jobs: list[dict], env: dict[str, str], cwd: str | None = None) -> list[dict]:
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, json.dumps(jobs), json.dumps(PROMPTS), str(MAX_TOKENS)],
                          env=env, cwd=cwd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_llm_loads_hub_ids_and_revisions_from_hf_hub_cache(hub):
    other_commit = commit_hash(f"{REPO}@other")
    jobs = [{"model": REPO}, {"model": REPO, "revision": "other"}, {"model": REPO, "revision": other_commit},
            {"model": REPO, "tokenizer_revision": "tok"}, {"model": REPO, "revision": "no-such-branch"},
            {"model": REPO, "revision": "other", "distributed_executor_backend": "mp"}]
    main, other, by_commit, tok, missing, in_worker = run_llm(jobs, offline_env(HF_HUB_CACHE=hub["cache"]))
    assert main["ids"] == hub["expected"][0]
    # A worker process loads the snapshot the core resolved, not the id's main.
    assert other["ids"] == by_commit["ids"] == in_worker["ids"] == hub["expected"][1]
    assert main["name"] == other["name"] == REPO            # served under its id, as vLLM does
    assert main["path"].startswith(hub["cache"]) and other["path"].endswith(other_commit)
    assert main["tokenizer"] == main["path"]
    # --tokenizer-revision: the tokenizer from its own snapshot, the weights still from main.
    assert tok["ids"] == hub["expected"][0]
    assert tok["tokenizer"].endswith(commit_hash(f"{REPO}@tok")) and tok["path"] == main["path"]
    assert REPO in missing["error"] and "no-such-branch" in missing["error"] and hub["cache"] in missing["error"]


def test_hf_home_and_download_dir_choose_the_cache(hub, tmp_path):
    home = tmp_path / "hf-home"
    shutil.copytree(hub["cache"], home / "hub", symlinks=True)
    [from_home] = run_llm([{"model": REPO}], offline_env(HF_HOME=str(home)))
    assert from_home["ids"] == hub["expected"][0] and from_home["path"].startswith(str(home / "hub"))
    empty = tmp_path / "empty-cache"
    empty.mkdir()
    jobs = [{"model": REPO, "download_dir": hub["cache"]}, {"model": REPO}]
    chosen, not_there = run_llm(jobs, offline_env(HF_HUB_CACHE=str(empty)))
    assert chosen["ids"] == hub["expected"][0] and chosen["path"].startswith(hub["cache"])
    assert REPO in not_there["error"] and str(empty) in not_there["error"]


def test_local_folder_with_the_same_spelling_wins(hub, tmp_path):
    local = tmp_path / "org" / "tiny"
    shutil.copytree(hub["folders"][1], local)     # the cache's main holds the other weights
    [got] = run_llm([{"model": REPO}], offline_env(HF_HUB_CACHE=hub["cache"]), cwd=str(tmp_path))
    assert got["ids"] == hub["expected"][1]
    assert got["path"] == str(local)


def test_engine_serve_hub_id_at_a_revision(hub, monkeypatch):
    for key in HF_ENV:           # the server inherits this environment
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", hub["cache"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    server = Server("--revision", "other", "--kv-cache-memory", "0.02", model=REPO, max_model_len=64)
    try:
        models = httpx.get(f"{server.url}/v1/models", headers=server.auth).json()
        assert [m["id"] for m in models["data"]] == [REPO]
        client = server.client()
        for prompt, want in zip(PROMPTS, hub["expected"][1]):
            out = client.completions.create(model=REPO, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
                                            logprobs=0)
            ids = [int(t.removeprefix("w")) for t in out.choices[0].logprobs.tokens]
            assert ids == want
    finally:
        server.stop()


def test_unknown_id_fails_at_start_in_one_line(tmp_path):
    env = offline_env(HF_HUB_CACHE=str(tmp_path))
    proc = subprocess.run([sys.executable, "-m", "pagedserve.frontend.cli", "nobody/nothing", "--port", "0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = [line for line in (proc.stdout + proc.stderr).splitlines() if line.strip()]
    assert len(lines) == 1, lines
    assert "Traceback" not in lines[0]
    assert "'nobody/nothing'" in lines[0] and str(tmp_path) in lines[0] and "HF_HUB_OFFLINE" in lines[0]


@pytest.mark.parametrize("model, is_id", [
    ("Qwen/Qwen2.5-0.5B-Instruct", True), ("gpt2", True), ("org/name.v2", True),
    ("/abs/org/name", False), ("./org/name", False), ("~/models/x", False), ("a/b/c", False),
    ("org/../name", False), ("model.gguf", False), ("org/na me", False)])
def test_what_counts_as_a_hub_id(model, is_id):
    assert looks_like_hub_id(model) is is_id
