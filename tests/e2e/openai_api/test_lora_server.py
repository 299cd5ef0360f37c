"""LoRA adapters over HTTP, as vLLM serves them: `--lora-modules` (both forms), `model` picking an adapter, the
adapters in /v1/models with their parent, concurrent requests mixing adapters and the base, runtime load,
unload and same-name reload, refusals with the reason while the server keeps serving, and
vllm:lora_requests_info."""
from __future__ import annotations

import json
import threading

import httpx
import pytest

from pagedserve.tests.helpers.models.lora_adapters import ALL_LINEAR, ATTENTION, make_lora, peft_greedy
from pagedserve.tests.helpers.processes.server import Server
from pagedserve.tests.helpers.models.tiny_models import random_prompts

PROMPTS = random_prompts(21, [12, 30, 8], 49152)
MAX_NEW = 8


@pytest.fixture(scope="module")
def adapters(tiny_serving_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("http_adapters")
    return {"a": make_lora(str(root / "a"), tiny_serving_model, r=8, alpha=16, targets=ATTENTION, seed=1),
            "b": make_lora(str(root / "b"), tiny_serving_model, r=4, alpha=8, targets=ALL_LINEAR, seed=2),
            "c": make_lora(str(root / "c"), tiny_serving_model, r=16, alpha=8, targets=ALL_LINEAR, seed=3),
            "big": make_lora(str(root / "big"), tiny_serving_model, r=32, alpha=32, targets=ATTENTION, seed=4)}


@pytest.fixture(scope="module")
def want(tiny_serving_model, adapters) -> dict[str | None, list[str]]:
    """PEFT's greedy continuations, as text (the server answers text)."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(tiny_serving_model)
    out = {n: peft_greedy(tiny_serving_model, adapters[n], PROMPTS, MAX_NEW) for n in ("a", "b", "c")}
    out[None] = peft_greedy(tiny_serving_model, None, PROMPTS, MAX_NEW)
    texts = {n: [tokenizer.decode(ids, skip_special_tokens=True) for ids in rows] for n, rows in out.items()}
    assert all(texts[n] != texts[None] for n in ("a", "b", "c"))
    return texts


def _complete(server: Server, model: str, prompt: list[int]) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers={"Authorization": f"Bearer {server.api_key}"},
                      json={"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0.0},
                      timeout=60)


def _tokens(server: Server, model: str, prompt: list[int]) -> str:
    resp = _complete(server, model, prompt)
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == model
    return body["choices"][0]["text"]


def test_adapters_over_http(tiny_serving_model, adapters, want):
    b_json = json.dumps({"name": "b", "path": adapters["b"], "base_model_name": "tiny"})
    server = Server("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--served-model-name", "tiny",
                    "--lora-modules", f"a={adapters['a']}", b_json, "--allow-runtime-lora-updating",
                    model=tiny_serving_model, token=None, max_model_len=256)
    auth = {"Authorization": f"Bearer {server.api_key}"}
    try:
        cards = httpx.get(f"{server.url}/v1/models", headers=auth).json()["data"]
        assert [(c["id"], c["parent"]) for c in cards] == [("tiny", None), ("a", "tiny"), ("b", "tiny")]
        assert cards[1]["root"] == adapters["a"]

        # Concurrently: every prompt under the base and both adapters.
        jobs = [(model, i) for model in ("tiny", "a", "b") for i in range(len(PROMPTS))]
        got: dict[tuple[str, int], str] = {}
        threads = [threading.Thread(target=lambda m=m, i=i: got.__setitem__((m, i), _tokens(server, m, PROMPTS[i])))
                   for m, i in jobs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert got == {(m, i): want[None if m == "tiny" else m][i] for m, i in jobs}
        metrics = httpx.get(f"{server.url}/metrics").text
        assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters=""' in metrics

        # Runtime: a refused load changes nothing; load, unload, and a same-name reload with other weights.
        bad = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=auth,
                         json={"lora_name": "big", "lora_path": adapters["big"]})
        assert bad.status_code == 400 and "rank 32, above max_lora_rank=16" in bad.json()["error"]["message"]
        taken = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=auth,
                           json={"lora_name": "a", "lora_path": adapters["c"]})
        assert taken.status_code == 400 and "already been loaded" in taken.json()["error"]["message"]
        ok = httpx.post(f"{server.url}/v1/load_lora_adapter", headers=auth,
                        json={"lora_name": "c", "lora_path": adapters["c"]})
        assert ok.status_code == 200 and "added successfully" in ok.text
        assert _tokens(server, "c", PROMPTS[0]) == want["c"][0]
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=auth,
                          json={"lora_name": "a"}).status_code == 200
        assert _complete(server, "a", PROMPTS[0]).status_code == 404
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=auth,
                          json={"lora_name": "a"}).status_code == 404
        assert httpx.post(f"{server.url}/v1/load_lora_adapter", headers=auth,
                          json={"lora_name": "a", "lora_path": adapters["c"]}).status_code == 200
        assert _tokens(server, "a", PROMPTS[1]) == want["c"][1]       # the new weights, not a's cached KV
        assert _tokens(server, "tiny", PROMPTS[2]) == want[None][2]
        assert [c["id"] for c in httpx.get(f"{server.url}/v1/models", headers=auth).json()["data"]] == \
            ["tiny", "b", "c", "a"]
    finally:
        server.stop()


def test_runtime_routes_need_the_switch_and_bad_modules_stop_the_start(tiny_serving_model, adapters):
    server = Server("--enable-lora", model=tiny_serving_model, token=None, max_model_len=256)
    try:
        resp = httpx.post(f"{server.url}/v1/load_lora_adapter", headers={"Authorization": f"Bearer {server.api_key}"},
                          json={"lora_name": "a", "lora_path": adapters["a"]})
        assert resp.status_code == 404
    finally:
        server.stop()
    with pytest.raises(RuntimeError, match="rank 32, above max_lora_rank=16"):
        Server("--enable-lora", "--lora-modules", f"big={adapters['big']}", model=tiny_serving_model, token=None,
               max_model_len=256, startup_s=120)
    with pytest.raises(RuntimeError, match="need --enable-lora"):
        Server("--lora-modules", f"a={adapters['a']}", model=tiny_serving_model, token=None, startup_s=60)


def test_lora_modules_take_both_of_vllms_forms():
    from pagedserve.frontend.cli import parse_args
    from pagedserve.frontend.lora.serving import LoRAModule, parse_lora_modules
    _, server = parse_args(["m", "--enable-lora", "--lora-modules", "a=/x", '{"name": "b", "path": "org/b"}',
                            "--lora-modules", "c=/z"])
    assert parse_lora_modules(server.lora_modules) == [LoRAModule("a", "/x"), LoRAModule("b", "org/b"),
                                                       LoRAModule("c", "/z")]
    for bad, match in [(("a",), "expected name=path"), (('{"name": "a"}',), "JSON object with name and path"),
                       (("a=/x", "a=/y"), "names an adapter twice")]:
        with pytest.raises(ValueError, match=match):
            parse_lora_modules(bad)
