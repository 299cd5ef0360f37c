"""Three engine-serve replicas behind `pagedserve router`, 64 clients sending for at least 60 s (issue 49), while
one replica is killed with SIGKILL and started again on its port, another is drained, and the third grows its
data parallelism from 1 to 2 and back. No non-streamed request fails (the router retries what failed before
its first byte); a stream on the killed replica ends with an error event within a second of the kill, then
[DONE]; every other stream finishes; the restarted replica rejoins the pool."""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import httpx
import pytest

from pagedserve.tests.helpers.processes.router import Router, wait_for
from pagedserve.tests.helpers.processes.server import API_KEY, SMALL_KV, TOKEN, Server

pytestmark = pytest.mark.timeout(900)

SERVE = (*SMALL_KV, "--max-num-seqs", "16")
CLIENTS, LOAD_S = 64, 60.0
ERROR_WITHIN_S = 1.0


@dataclass
class Stream:
    started: float
    ended: float = 0.0
    error_at: float | None = None       # when an error event came, if one did
    done: bool = False                  # [DONE] came


class Load:
    """CLIENTS threads, each sending back to back (every fourth request streamed) until stopped."""

    def __init__(self, router: Router, model: str) -> None:
        self.router, self.model = router, model
        self.failures: list[str] = []
        self.streams: list[Stream] = []
        self.completed = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(CLIENTS)
        self._runs = [self._pool.submit(self._run, i) for i in range(CLIENTS)]

    def _run(self, worker: int) -> None:
        with httpx.Client(base_url=self.router.url, headers=self.router.auth, timeout=120) as http:
            n = 0
            while not self._stop.is_set():
                n += 1
                body = {"model": self.model, "prompt": f"client {worker} request {n}: rivers", "max_tokens": 12,
                        "temperature": 0, "ignore_eos": True}
                try:
                    if n % 4 == 0:
                        self._stream(http, body)
                    else:
                        r = http.post("/v1/completions", json=body)
                        if r.status_code != 200 or r.json()["usage"]["completion_tokens"] != 12:
                            raise AssertionError(f"{r.status_code} {r.text[:300]}")
                    with self._lock:
                        self.completed += 1
                except Exception as exc:             # every failure is the test's to report
                    with self._lock:
                        self.failures.append(f"client {worker} request {n}: {type(exc).__name__}: {exc}")

    def _stream(self, http: httpx.Client, body: dict) -> None:
        record = Stream(started=time.monotonic())
        with self._lock:
            self.streams.append(record)
        with http.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
            if r.status_code != 200:
                raise AssertionError(f"stream {r.status_code}")
            for line in r.iter_lines():
                if line == "data: [DONE]":
                    record.done = True
                elif line.startswith("data: ") and "error" in json.loads(line[6:]):
                    record.error_at = time.monotonic()
        record.ended = time.monotonic()
        if not record.done:
            raise AssertionError("a stream ended without [DONE]")

    def stop(self) -> None:
        self._stop.set()
        for run in self._runs:
            run.result(timeout=180)
        self._pool.shutdown()


def _start(model: str, *extra: str, port: int | None = None) -> Server:
    # An elastic server starts its engine cores on sockets of its own: no --engine-address for it.
    token = None if "--enable-elastic-ep" in extra else TOKEN
    return Server(*SERVE, *extra, model=model, max_model_len=512, port=port, token=token)


def _post(srv: Server, path: str, body: object) -> httpx.Response:
    return httpx.post(f"{srv.url}{path}", headers=srv.auth, json=body, timeout=180)


def test_kill_drain_and_scale_under_load_lose_no_request(tiny_serving_model):
    with ThreadPoolExecutor(3) as starting:
        starts = [starting.submit(_start, tiny_serving_model, *extra) for extra in [(), (), ("--enable-elastic-ep",)]]
    started = [s.result() for s in starts if s.exception() is None]
    if len(started) < 3:                      # stop the ones that came up before failing on the one that did not
        for server in started:
            server.stop()
        next(s for s in starts if s.exception() is not None).result()
    killed, drained, scaled = started
    servers = [killed, drained, scaled]
    router = Router(*(s.url for s in servers), backend_key=API_KEY, routing="least-load")
    load = None
    try:
        model = killed.client().models.list().data[0].id
        begun = time.monotonic()
        load = Load(router, model)
        wait_for(lambda: killed.metric("num_requests_running") >= 1, 60, "requests on the replica to kill")
        os.kill(killed.proc.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        wait_for(lambda: router.healthy_count() == 2, 5, "the killed replica to leave the pool")
        killed.stop()
        servers[0] = restarted = _start(tiny_serving_model, port=killed.port)
        wait_for(lambda: router.healthy_count() == 3, 10, "the restarted replica to rejoin")
        wait_for(lambda: restarted.metrics().get("request_success_total", 0) >= 1, 60, "the rejoined replica to serve")

        wait_for(lambda: drained.metric("num_requests_running") >= 1, 60, "requests on the replica to drain")
        assert _post(drained, "/drain", None).status_code == 202
        assert drained.proc.wait(120) == 0
        wait_for(lambda: router.healthy_count() == 2, 5, "the drained replica to leave the pool")

        for size in (2, 1):
            r = _post(scaled, "/scale", {"new_data_parallel_size": size})
            assert r.status_code == 200 and r.json()["data_parallel_size"] == size, r.text
        wait_for(lambda: time.monotonic() - begun >= LOAD_S, LOAD_S, "the load's full minute")
    finally:
        if load is not None:
            load.stop()
        router.stop()
        for server in servers:
            server.stop()
    broken = [s for s in load.streams if s.error_at is not None]
    assert load.failures == [], load.failures[:5]
    assert load.completed > 10 * CLIENTS
    assert all(s.started < killed_at and s.error_at - killed_at <= ERROR_WITHIN_S for s in broken), \
        [(s.started - killed_at, s.error_at - killed_at) for s in broken]
    assert all(s.done for s in load.streams)
    assert len(load.streams) - len(broken) > 2 * CLIENTS
