"""`pagedserve router` as a real subprocess on a free port, and a static upstream (a real HTTP server in a
thread) for the behaviour no engine shows on demand (every replica answering 429)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import openai

from pagedserve.tests.helpers.processes.server import free_port, stop_process

ROUTER_KEY = "router-key-456"


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out waiting for {what}")
        time.sleep(0.1)


class Router:
    """`pagedserve router --backend ...` until it reports `healthy` replicas."""

    def __init__(self, *backends: str, routing: str = "roundrobin", backend_key: str | None = None,
                 extra: tuple[str, ...] = (), healthy: int | None = None, startup_s: float = 60,
                 env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tempfile.mkdtemp(prefix="ps-test-router-"), "router.log")
        cmd = [sys.executable, "-m", "pagedserve.frontend.pagedserve_cli", "router", "--port", str(self.port),
               "--api-key", ROUTER_KEY, "--routing-logic", routing, "--health-check-interval", "0.5",
               "--log-level", "info", *extra]
        for url in backends:
            cmd += ["--backend", url]
        if backend_key:
            cmd += ["--backend-api-key", backend_key]
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})
        want = len(backends) if healthy is None else healthy
        wait_for(lambda: self._healthy_count() == want, startup_s, f"the router to see {want} replicas")

    def _healthy_count(self) -> int | None:
        if self.proc.poll() is not None:
            raise RuntimeError(f"the router exited: {self.output()[-3000:]}")
        try:
            return httpx.get(f"{self.url}/health", timeout=2).json()["healthy_replicas"]
        except (httpx.HTTPError, ValueError):
            return None

    def healthy_count(self) -> int | None:
        return self._healthy_count()

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=ROUTER_KEY, max_retries=0, timeout=120)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {ROUTER_KEY}"}

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def metrics_text(self) -> str:
        return httpx.get(f"{self.url}/metrics", timeout=10).text

    def stop(self) -> None:
        stop_process(self.proc)


class StaticUpstream:
    """A healthy OpenAI-shaped server listing `model` that answers every POST with `status` (and
    `Retry-After: retry_after`), and GET /metrics with `self.metrics` (Prometheus text, settable at any time).
    `posts` and `metrics_reads` count what it was asked."""

    def __init__(self, model: str, status: int, retry_after: int, metrics: str = "") -> None:
        self.metrics = metrics
        self.posts = 0
        self.metrics_reads = 0
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path == "/metrics":
                    upstream.metrics_reads += 1
                    self._answer_text(upstream.metrics)
                    return
                body = {"object": "list", "data": [{"id": model, "object": "model"}]} \
                    if self.path == "/v1/models" else {}
                self._answer(200, body)

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("content-length", 0)))
                upstream.posts += 1
                self._answer(status, {"error": {"message": "busy", "type": "rate_limit_error", "code": status}},
                             {"Retry-After": str(retry_after)})

            def _answer_text(self, text: str) -> None:
                data = text.encode()
                self.send_response(200)
                self.send_header("content-type", "text/plain; version=0.0.4")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def _answer(self, code: int, body: dict, headers: dict[str, str] | None = None) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                for k, v in (headers or {}).items():
                    self.send_header(k, v)
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
