"""`pagedserve router` over real engine-serve replicas on 127.0.0.1 (issue 49): the openai SDK through it,
the routing logics (read from the replicas' own request counters), failover on kill -9, drain with no failed
request, and back-pressure (429) from a static upstream."""
from __future__ import annotations

import json
import os
import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from pagedserve.tests.helpers.processes.router import Router, StaticUpstream, wait_for
from pagedserve.tests.helpers.processes.server import API_KEY, SMALL_KV, Server

pytestmark = pytest.mark.timeout(600)

SERVE = (*SMALL_KV, "--max-num-seqs", "8")
DONE = "request_success_total"


def _replica(model: str) -> Server:
    return Server(*SERVE, model=model, max_model_len=512)


@pytest.fixture(scope="module")
def replicas(tiny_serving_model):
    pair = [_replica(tiny_serving_model), _replica(tiny_serving_model)]
    yield pair
    for server in pair:
        server.stop()


@pytest.fixture(scope="module")
def model_id(replicas) -> str:
    return replicas[0].client().models.list().data[0].id


def _router(*servers, **kwargs) -> Router:
    return Router(*(s.url for s in servers), backend_key=API_KEY, **kwargs)


def _done_counts(servers) -> list[float]:
    return [s.metrics()[DONE] for s in servers]      # 0 before a replica's first request


def _deltas_after(servers, send) -> list[float]:
    """How many requests each replica finished while `send()` ran (its own vllm:request_success)."""
    before = _done_counts(servers)
    sent = send()
    wait_for(lambda: sum(_done_counts(servers)) - sum(before) >= sent, 60, "the replicas to count the requests")
    return [a - b for a, b in zip(_done_counts(servers), before)]


def _complete(client, model_id: str, prompt: str, **kw) -> str:
    out = client.completions.create(model=model_id, prompt=prompt, max_tokens=kw.pop("max_tokens", 8),
                                    temperature=0, **kw)
    return out.choices[0].text


def test_sdk_through_the_router_answers_as_a_replica(replicas, model_id):
    router = _router(*replicas)
    try:
        direct = _complete(replicas[0].client(), model_id, "The capital of France is", max_tokens=16)
        client = router.client()
        assert [m.id for m in client.models.list().data] == [model_id]
        assert _complete(client, model_id, "The capital of France is", max_tokens=16) == direct
        stream = client.completions.create(model=model_id, prompt="The capital of France is", max_tokens=16,
                                           temperature=0, stream=True)
        assert "".join(c.choices[0].text for c in stream if c.choices) == direct
        chat = dict(model=model_id, messages=[{"role": "user", "content": "Hi"}], max_tokens=8, temperature=0)
        want = replicas[1].client().chat.completions.create(**chat).choices[0].message.content
        assert client.chat.completions.create(**chat).choices[0].message.content == want
        chunks = client.chat.completions.create(**chat, stream=True)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
        assert httpx.post(f"{router.url}/v1/completions", json={"model": model_id, "prompt": "x"}).status_code == 401
        wrong = httpx.post(f"{router.url}/v1/completions", headers=router.auth, json={"model": "nope", "prompt": "x"})
        assert wrong.status_code == 404
    finally:
        router.stop()


def test_roundrobin_alternates(replicas, model_id):
    router = _router(*replicas)
    try:
        def send() -> int:
            for i in range(4):
                _complete(router.client(), model_id, f"count {i}")
            return 4
        assert _deltas_after(replicas, send) == [2, 2]
        assert 'pagedserve_router:routing_decisions_total{decision="roundrobin",logic="roundrobin"} 4.0' \
            in router.metrics_text()
    finally:
        router.stop()


def test_session_affinity_pins(replicas, model_id):
    router = _router(*replicas, routing="session")
    try:
        for session in ("alice", "bob"):
            def send() -> int:
                for i in range(3):
                    router.client().completions.create(model=model_id, prompt=f"turn {i}", max_tokens=4,
                                                       extra_headers={"x-session-id": session})
                return 3
            assert sorted(_deltas_after(replicas, send)) == [0, 3]
        # The body's user field names a session too.
        def by_user() -> int:
            for i in range(3):
                router.client().completions.create(model=model_id, prompt=f"u {i}", max_tokens=4, user="carol")
            return 3
        assert sorted(_deltas_after(replicas, by_user)) == [0, 3]
    finally:
        router.stop()


def test_prefix_routing_keeps_a_shared_prefix_on_one_replica(replicas, model_id):
    router = _router(*replicas, routing="prefix")
    shared = "You are a careful assistant who answers in one short sentence. " * 5
    try:
        for question in ("Name a colour.", "Name a fruit."):
            # Round-robin would alternate: two pairs of requests, each pair on one replica.
            def send() -> int:
                _complete(router.client(), model_id, f"{question} {shared} first", max_tokens=4)
                _complete(router.client(), model_id, f"{question} {shared} second", max_tokens=4)
                return 2
            assert sorted(_deltas_after(replicas, send)) == [0, 2]
        assert 'decision="prefix-hit"' in router.metrics_text()
    finally:
        router.stop()


def test_every_replica_429_gives_429_with_retry_after():
    upstreams = [StaticUpstream("m", 429, retry_after=7), StaticUpstream("m", 429, retry_after=3)]
    router = Router(*(u.url for u in upstreams))
    try:
        r = httpx.post(f"{router.url}/v1/completions", headers=router.auth, json={"model": "m", "prompt": "x"})
        assert r.status_code == 429 and r.headers["retry-after"] == "7"
        assert r.json()["error"]["code"] == 429
        assert 'pagedserve_router:requests_total{outcome="overloaded",replica="none"} 1.0' in router.metrics_text()
    finally:
        router.stop()
        for u in upstreams:
            u.close()


def test_killed_replica_is_retried_around_and_leaves_the_pool(replicas, model_id, tiny_serving_model):
    victim = _replica(tiny_serving_model)
    both, alone = _router(replicas[0], victim), _router(victim)
    try:
        # A stream on the victim when it dies ends with an error event, then [DONE].
        body = {"model": model_id, "prompt": "Once", "max_tokens": 400, "ignore_eos": True, "stream": True}
        with httpx.Client(timeout=30) as http, http.stream("POST", f"{alone.url}/v1/completions", json=body,
                                                           headers=alone.auth) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))
            with ThreadPoolExecutor(6) as pool:
                futures = [pool.submit(_complete, both.client(), model_id, f"kill {i}", max_tokens=24)
                           for i in range(6)]
                wait_for(lambda: victim.metric("num_requests_running") >= 2, 60, "requests on the victim")
                os.kill(victim.proc.pid, signal.SIGKILL)
                texts = [f.result() for f in futures]         # none fails: retried on the replica left
            rest = [line for line in lines if line.startswith("data: ")]
        assert len(texts) == 6
        assert "error" in json.loads(rest[-2][6:]) and rest[-1] == "data: [DONE]"
        wait_for(lambda: both.healthy_count() == 1, 5, "the dead replica to leave the pool")
        assert "pagedserve_router:retries_total" in both.metrics_text()
        assert _complete(both.client(), model_id, "after") is not None
    finally:
        both.stop()
        alone.stop()
        victim.stop()
        for child in victim.children() if victim.proc.poll() is None else []:
            child.kill()


def test_draining_replica_leaves_the_pool_with_no_failed_request(replicas, model_id, tiny_serving_model):
    victim = _replica(tiny_serving_model)
    router = _router(replicas[0], victim)
    try:
        with ThreadPoolExecutor(8) as pool:
            futures = [pool.submit(_complete, router.client(), model_id, f"drain {i}", max_tokens=24)
                       for i in range(8)]
            wait_for(lambda: victim.metric("num_requests_running") >= 1, 60, "requests on the victim")
            assert httpx.post(f"{victim.url}/drain", headers=victim.auth, timeout=10).status_code == 202
            later = [pool.submit(_complete, router.client(), model_id, f"later {i}") for i in range(6)]
            texts = [f.result() for f in futures + later]
        assert len(texts) == 14
        wait_for(lambda: router.healthy_count() == 1, 5, "the draining replica to leave the pool")
        assert victim.proc.wait(60) == 0
    finally:
        router.stop()
        victim.stop()
