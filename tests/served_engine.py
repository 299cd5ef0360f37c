"""engine-serve as a real subprocess (tests/reliability): start, probe /metrics, measure its processes, stop."""
from __future__ import annotations

import collections
import signal
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import psutil

API_KEY = "reliability-key"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServedEngine:
    def __init__(self, model: str, *extra: str, api_key: str | None = API_KEY, startup_s: float = 180) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "pagedserve.frontend.cli", model, "--port", str(self.port),
               "--dtype", "float32", "--log-level", "warning", "--kv-cache-memory", "0.25", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        # A file, not a pipe: nobody reads the log while the server runs, and a full pipe would block it.
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, text=True)
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine-serve exited: {self.log_tail()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError("engine-serve did not become healthy")

    def log_tail(self, chars: int = 3000) -> str:
        self.log.seek(0)
        return self.log.read()[-chars:]

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def async_client(self, timeout_s: float = 120) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key or "none", max_retries=0,
                                  timeout=timeout_s)

    def metrics(self) -> dict[str, float]:
        """pagedserve:* samples of /metrics, summed over labels."""
        values: dict[str, float] = collections.defaultdict(float)
        for line in httpx.get(f"{self.url}/metrics", timeout=10).text.splitlines():
            if line.startswith("pagedserve:"):
                name = line.split("{", 1)[0].split(" ", 1)[0][len("pagedserve:"):]
                values[name] += float(line.rsplit(" ", 1)[1])
        return values

    def wait_idle(self, timeout_s: float = 30) -> dict[str, float]:
        """Metrics once nothing runs or waits and the KV pool is free, or the last reading at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            m = self.metrics()
            if not (m["num_requests_running"] or m["num_requests_waiting"] or m["kv_cache_usage_perc"]):
                return m
            if time.monotonic() > deadline:
                return m
            time.sleep(0.2)

    def processes(self) -> list[psutil.Process]:
        root = psutil.Process(self.proc.pid)
        return [root, *root.children(recursive=True)]

    def usage(self) -> tuple[int, int]:
        """(RSS bytes, open fds) of the server and all its children."""
        rss = fds = 0
        for p in self.processes():
            rss += p.memory_info().rss
            fds += p.num_fds()
        return rss, fds

    def stop(self) -> None:
        kids = self.processes() if self.proc.poll() is None else []
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        _, alive = psutil.wait_procs(kids, timeout=15)
        for p in alive:
            p.kill()
        self.log.close()
