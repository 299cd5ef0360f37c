"""Graceful drain of a real engine-serve (issue 49): on SIGTERM a stream in flight runs to its end, a new
request meanwhile gets 503 with Retry-After, /health turns unready, and the process exits 0."""
from __future__ import annotations

import json
import signal

import httpx
import pytest

from pagedserve.tests.helpers.processes.server import SMALL_KV, Server

pytestmark = pytest.mark.timeout(300)

MAX_TOKENS = 400


def test_sigterm_drains_the_stream_in_flight_then_exits_0(tiny_serving_model):
    server = Server(*SMALL_KV, "--shutdown-timeout", "60", model=tiny_serving_model,
                    max_model_len=512)
    try:
        body = {"model": server.client().models.list().data[0].id, "prompt": "Once upon a time",
                "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}
        usage, finish, done = None, None, False
        with httpx.Client(base_url=server.url, headers=server.auth, timeout=120) as http, \
                http.stream("POST", "/v1/completions", json=body) as stream:
            lines = stream.iter_lines()
            next(line for line in lines if line.startswith("data: "))     # the stream has begun
            server.proc.send_signal(signal.SIGTERM)
            # The drain starts on the server's loop: wait for its sign, a new request refused.
            refused = _wait_refused(server)
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == 503
            assert httpx.get(f"{server.url}/health", timeout=10).status_code == 503
            assert server.proc.poll() is None, "the server exited with a stream in flight"
            for line in lines:
                if line == "data: [DONE]":
                    done = True
                elif line.startswith("data: "):
                    chunk = json.loads(line[6:])
                    usage = chunk.get("usage") or usage
                    finish = next((c["finish_reason"] for c in chunk["choices"] if c["finish_reason"]), finish)
        assert done and finish == "length"
        assert usage["completion_tokens"] == MAX_TOKENS
        assert server.proc.wait(60) == 0, server.output()[-3000:]
    finally:
        server.stop()


def _wait_refused(server: Server) -> httpx.Response:
    """The first answer to a new request once the drain has begun (a 503), polled on a bounded budget."""
    with httpx.Client(base_url=server.url, headers=server.auth, timeout=30) as http:
        for _ in range(200):
            r = http.get("/v1/models")
            if r.status_code == 503:
                return r
            assert r.status_code == 200
        raise AssertionError("no request was refused after SIGTERM")
