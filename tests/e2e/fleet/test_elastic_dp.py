"""Elastic data parallelism (issue 49): `engine-serve --enable-elastic-ep` grows from one engine core to two and
back under load from real openai clients, streaming and not, with no failed request; the engine count is in
/health and /is_scaling_elastic_ep, the new engine's series in /metrics; bad sizes get 400s naming the field, a
second scale while one runs a 409, and a server without the flag says it cannot scale."""
from __future__ import annotations

import re
import threading

import httpx
import openai
import pytest

from pagedserve.tests.helpers.processes.router import wait_for
from pagedserve.tests.helpers.processes.server import SMALL_KV, Server

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 24
# Four such streams, two on each engine: seconds of decoding even on a quiet machine, past a drain timeout of 1 s
# (the tiny model's context is 512); the test hangs up on them once it has seen what it needs.
LONG_TOKENS, LONG_REQUESTS = 480, 4


@pytest.fixture(scope="module")
def server(tiny_serving_model):
    srv = Server("--enable-elastic-ep", *SMALL_KV, "--max-num-seqs", "8", model=tiny_serving_model, token=None,
                 max_model_len=512)
    yield srv
    srv.stop()


def _post(srv: Server, path: str, body: object, timeout_s: float = 120) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", headers=srv.auth, json=body, timeout=timeout_s)


def _size(srv: Server) -> int:
    status = _post(srv, "/is_scaling_elastic_ep", None).json()
    engines = httpx.get(f"{srv.url}/health", timeout=10).json()["engines"]
    assert len(engines) == status["data_parallel_size"], (engines, status)
    return status["data_parallel_size"]


def _engine_gauge(srv: Server, name: str, engine: int) -> float:
    text = httpx.get(f"{srv.url}/metrics", timeout=10).text
    found = re.findall(rf'^vllm:{name}{{[^}}]*engine="{engine}"[^}}]*}} (\S+)$', text, re.M)
    return sum(float(v) for v in found)


def _request(client: openai.OpenAI, model: str, prompt: str, stream: bool, max_tokens: int = MAX_TOKENS) -> None:
    """One completion, which must make exactly max_tokens tokens (ignore_eos) and end for its length."""
    kw = dict(model=model, prompt=prompt, max_tokens=max_tokens, temperature=0, extra_body={"ignore_eos": True})
    if not stream:
        out = client.completions.create(**kw)
        assert out.usage.completion_tokens == max_tokens and out.choices[0].finish_reason == "length", out
        return
    chunks = list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == max_tokens, chunks[-1]
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


class Load:
    """Four clients sending `_request`s back to back (even ones streamed) until stopped; `failures` holds what
    went wrong."""

    def __init__(self, srv: Server, model: str) -> None:
        self.model, self.done, self.failures = model, 0, []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._clients = [srv.client() for _ in range(4)]
        self._threads = [threading.Thread(target=self._run, args=(i,)) for i in range(4)]
        for t in self._threads:
            t.start()

    def _run(self, worker: int) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            try:
                _request(self._clients[worker], self.model, f"worker {worker} request {n}: about rivers", n % 2 == 0)
                with self._lock:
                    self.done += 1
            except (openai.APIError, AssertionError) as exc:
                with self._lock:
                    self.failures.append(f"worker {worker} request {n}: {type(exc).__name__}: {exc}")

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(120)


def test_grow_and_shrink_under_load_fail_no_request(server):
    model = server.client().models.list().data[0].id
    assert _size(server) == 1
    load = Load(server, model)
    try:
        wait_for(lambda: load.done >= 4, 60, "the load to run")
        grown = _post(server, "/scale", {"new_data_parallel_size": 2})
        assert grown.status_code == 200, grown.text
        assert grown.json()["data_parallel_size"] == 2 and _size(server) == 2
        # The new engine takes a share, and the shrink finds requests on it: they finish there before it stops.
        wait_for(lambda: _engine_gauge(server, "num_requests_running", 1) >= 1, 60, "requests on engine 1")
        served_before = load.done
        shrunk = _post(server, "/scale_elastic_ep", {"new_data_parallel_size": 1, "drain_timeout": 60})
        assert shrunk.status_code == 200, shrunk.text
        assert _size(server) == 1 and _engine_gauge(server, "num_requests_running", 1) == 0
        wait_for(lambda: load.done >= served_before + 4, 60, "the load to run on one engine")
    finally:
        load.stop()
    assert load.failures == [], load.failures[:5]
    assert _engine_gauge(server, "request_success_total", 1) > 0       # engine 1 did serve while it was there
    assert httpx.get(f"{server.url}/health", timeout=10).json()["status"] == "ok"


def test_bad_sizes_are_400s_naming_the_field(server):
    for body, field in (({}, "new_data_parallel_size"), ({"new_data_parallel_size": 0}, "new_data_parallel_size"),
                        ({"new_data_parallel_size": -1}, "new_data_parallel_size"),
                        ({"new_data_parallel_size": "2"}, "new_data_parallel_size"),
                        ({"new_data_parallel_size": True}, "new_data_parallel_size"),
                        ({"new_data_parallel_size": 1.5}, "new_data_parallel_size"),
                        ({"new_data_parallel_size": 2, "drain_timeout": 0}, "drain_timeout")):
        r = _post(server, "/scale", body)
        assert r.status_code == 400, (body, r.text)
        assert r.json()["error"]["param"] == field, (body, r.text)
    for content in (b"not json", b"[2]"):
        r = httpx.post(f"{server.url}/scale_elastic_ep", headers=server.auth, content=content, timeout=10)
        assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert httpx.post(f"{server.url}/scale", json={"new_data_parallel_size": 2}, timeout=10).status_code == 401
    assert _size(server) == 1


def test_a_second_scale_while_one_runs_is_a_409(server):
    first: list[httpx.Response] = []
    grow = threading.Thread(target=lambda: first.append(_post(server, "/scale", {"new_data_parallel_size": 2})))
    grow.start()
    try:
        wait_for(lambda: _post(server, "/is_scaling_elastic_ep", None).json()["is_scaling_elastic_ep"], 30,
                 "the scale to start")
        second = _post(server, "/scale", {"new_data_parallel_size": 3})
        assert second.status_code == 409, second.text
    finally:
        grow.join(120)
    assert first[0].status_code == 200, first[0].text
    assert _size(server) == 2


def test_a_shrink_whose_engines_stay_busy_past_the_timeout_is_called_off(server):
    """A 408; the engines serve on (their streams keep streaming; new requests reach engine 1 again); the clients
    then hang up, and the later shrink succeeds."""
    if _size(server) != 2:
        assert _post(server, "/scale", {"new_data_parallel_size": 2}).status_code == 200
    model = server.client().models.list().data[0].id
    hang_up = threading.Event()
    chunks = [0] * LONG_REQUESTS

    def long_stream(i: int) -> None:
        body = {"model": model, "prompt": f"long request {i}", "max_tokens": LONG_TOKENS, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.url}/v1/completions", headers=server.auth, json=body, timeout=120) as r:
            for line in r.iter_lines():
                chunks[i] += line.startswith("data: {")
                if hang_up.is_set():
                    return       # leaving the block closes the connection: the server aborts the request
    threads = [threading.Thread(target=long_stream, args=(i,)) for i in range(LONG_REQUESTS)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: _engine_gauge(server, "num_requests_running", 1) >= 1, 60, "a request on engine 1")
        r = _post(server, "/scale", {"new_data_parallel_size": 1, "drain_timeout": 1})
        assert r.status_code == 408 and "serve on" in r.json()["error"]["message"], r.text
        assert _size(server) == 2
        assert [e["state"] for e in httpx.get(f"{server.url}/health", timeout=10).json()["engines"]] == ["ok", "ok"]
        seen = sum(chunks)
        wait_for(lambda: sum(chunks) > seen + LONG_REQUESTS, 60, "the streams to go on")
    finally:
        hang_up.set()
        for t in threads:
            t.join(120)
    assert _post(server, "/scale", {"new_data_parallel_size": 1}).status_code == 200
    assert _size(server) == 1


def test_a_fixed_server_cannot_scale(api_server):
    r = httpx.post(f"{api_server.url}/scale", headers=api_server.auth, json={"new_data_parallel_size": 2}, timeout=10)
    assert r.status_code == 400 and "--enable-elastic-ep" in r.json()["error"]["message"], r.text
