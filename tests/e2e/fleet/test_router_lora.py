"""`pagedserve router --routing-logic lora` over two real tiny-model engine-serve replicas with LoRA and
runtime loading: requests for an adapter go where it is loaded; one no replica has is loaded on one (once,
however many requests ask for it at the same time) and then served there; an adapter whose only holder
drained is loaded elsewhere from the path that holder listed; the answers are the replicas' own.
Which replica answered is read from the replicas' own request counters and /v1/models."""
from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedserve.tests.helpers.models.lora_adapters import ATTENTION, make_lora
from pagedserve.tests.helpers.processes.router import Router, wait_for
from pagedserve.tests.helpers.processes.server import API_KEY, Server

pytestmark = pytest.mark.timeout(600)

LORA = ("--enable-lora", "--max-loras", "2", "--max-lora-rank", "16", "--served-model-name", "tiny",
        "--allow-runtime-lora-updating", "--max-num-seqs", "4")
DONE = "request_success_total"


@pytest.fixture(scope="module")
def adapters(tiny_serving_model, tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("router_loras")
    return {name: make_lora(str(root / name), tiny_serving_model, r=8, alpha=16, targets=ATTENTION, seed=seed)
            for seed, name in enumerate(("a", "b", "c"))}


@pytest.fixture(scope="module")
def replicas(tiny_serving_model, adapters):
    pair = [Server(*LORA, "--lora-modules", f"a={adapters['a']}", model=tiny_serving_model, max_model_len=256),
            Server(*LORA, model=tiny_serving_model, max_model_len=256)]
    yield pair
    for server in pair:
        server.stop()


def _listed(server: Server) -> list[str]:
    return [c["id"] for c in httpx.get(f"{server.url}/v1/models", headers=server.auth, timeout=10).json()["data"]]


def _complete(base_url: str, key: str, model: str, prompt: str) -> httpx.Response:
    return httpx.post(f"{base_url}/v1/completions", headers={"Authorization": f"Bearer {key}"}, timeout=120,
                      json={"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0})


def _counts(servers) -> list[float]:
    return [s.metrics()[DONE] for s in servers]


def test_adapters_go_where_they_are_loaded_and_get_loaded_where_none_is(replicas, adapters):
    first, second = replicas
    router = Router(first.url, second.url, routing="lora", backend_key=API_KEY,
                    extra=("--lora-modules", f"b={adapters['b']}"))
    try:
        key = router.auth["Authorization"].split()[1]
        # a: only the first replica has it, so every request for it goes there, answered as it answers.
        want = _complete(first.url, API_KEY, "a", "Once upon").json()["choices"][0]["text"]
        before = _counts(replicas)
        for _ in range(3):
            assert _complete(router.url, key, "a", "Once upon").json()["choices"][0]["text"] == want
        wait_for(lambda: sum(_counts(replicas)) - sum(before) >= 3, 60, "the counters")
        assert [x - y for x, y in zip(_counts(replicas), before)] == [3, 0]

        # b: no replica has it. Four requests at once: it is loaded on one replica, once, and all are served.
        with ThreadPoolExecutor(4) as pool:
            answers = list(pool.map(lambda i: _complete(router.url, key, "b", "Hello there"), range(4)))
        assert [r.status_code for r in answers] == [200] * 4, [r.text for r in answers]
        holders = [s for s in replicas if "b" in _listed(s)]
        assert len(holders) == 1
        direct = _complete(holders[0].url, API_KEY, "b", "Hello there").json()["choices"][0]["text"]
        assert {r.json()["choices"][0]["text"] for r in answers} == {direct}
        assert "lora-load" in router.metrics_text()
        # ... and later requests for b stay where it is.
        before = _counts(replicas)
        for _ in range(2):
            assert _complete(router.url, key, "b", "Hi").status_code == 200
        wait_for(lambda: sum(_counts(replicas)) - sum(before) >= 2, 60, "the counters")
        assert [x - y for x, y in zip(_counts(replicas), before)] == [2 if s is holders[0] else 0 for s in replicas]

        # An adapter no replica lists and the router has no path for: 404 naming the field.
        unknown = _complete(router.url, key, "c", "x")
        assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"
        assert _complete(router.url, key, "tiny", "x").status_code == 200

        # a's only holder drains and leaves: a is loaded on the other from the path the first one listed.
        first.proc.send_signal(signal.SIGTERM)
        assert first.proc.wait(60) == 0
        wait_for(lambda: router.healthy_count() == 1, 30, "the drained replica to leave the pool")
        moved = _complete(router.url, key, "a", "Once upon")
        assert moved.status_code == 200 and moved.json()["choices"][0]["text"] == want
        assert "a" in _listed(second)
    finally:
        router.stop()
