"""engine-serve as a real subprocess for tests: free ports, its own TMPDIR, every line it prints kept."""
from __future__ import annotations

import os
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time

import httpx
import openai
import psutil

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "scripts"))
import soak  # noqa: E402

API_KEY = "test-key-123"
TOKEN = "engine-token-abc"
SMALL_KV = ("--kv-cache-memory", "0.25")      # GiB: servers that live through a module need not hold 2


def free_port(avoid: set[int] = frozenset()) -> int:
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in avoid:
            return port


def free_port_pair() -> int:
    """A port P such that P and P + 1 are both free now."""
    while True:
        port = free_port()
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        return port


class Server:
    """`engine-serve MODEL` on a free port, its engine core on tcp with a token.

    Its TMPDIR is a private folder, so the ipc files of the engine it starts can be checked; stdout and
    stderr of the server and all its children go to one file (a pipe nobody reads would block it).
    """

    def __init__(self, *extra: str, model: str | None = None, api_key: str = API_KEY, token: str = TOKEN,
                 log_level: str = "warning", max_model_len: int = 1024, startup_s: float = 180,
                 tls: tuple[str, str] | None = None) -> None:
        """tls: (certificate, key) files: serve HTTPS, and trust that certificate here."""
        self.engine_port = free_port_pair()       # the engine core listens on PORT and PORT + 1
        self.port = free_port(avoid={self.engine_port, self.engine_port + 1})
        self.api_key, self.token = api_key, token
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=tls[0]) if tls else True
        if tls:
            extra = (*extra, "--ssl-certfile", tls[0], "--ssl-keyfile", tls[1])
        self.tmpdir = tempfile.mkdtemp(prefix="ps-test-srv-")
        self.log_path = os.path.join(self.tmpdir, "server.log")
        cmd = [sys.executable, "-m", "pagedserve.frontend.cli", *([model] if model else []), "--port", str(self.port),
               "--dtype", "float32", "--max-model-len", str(max_model_len), "--api-key", api_key,
               "--engine-address", f"tcp://127.0.0.1:{self.engine_port}", "--engine-token", token,
               "--log-level", log_level, *extra]
        env = dict(os.environ, TMPDIR=self.tmpdir)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        self._wait_healthy(startup_s)

    def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"engine-serve exited: {self.output()[-3000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise TimeoutError(f"engine-serve did not become healthy: {self.output()[-3000:]}")

    def output(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=120)

    def async_client(self, timeout_s: float = 120) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.url}/v1", api_key=self.api_key, max_retries=0, timeout=timeout_s)

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def metrics(self) -> dict[str, float]:
        """pagedserve:* samples of /metrics, summed over labels (the soak script's reader)."""
        return soak.read_metrics(self.url)

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

    def usage(self) -> tuple[int, int]:
        """(RSS bytes, open fds) of the server and all its children."""
        rss = fds = 0
        for p in [psutil.Process(self.proc.pid), *self.children()]:
            rss += p.memory_info().rss
            fds += p.num_fds()
        return rss, fds

    def health(self) -> int:
        return httpx.get(f"{self.url}/health", timeout=10, verify=self.verify).status_code

    def metric(self, name: str) -> float:
        text = httpx.get(f"{self.url}/metrics").text
        for line in text.splitlines():
            if line.startswith(f"pagedserve:{name}{{") or line.startswith(f"pagedserve:{name} "):
                return float(line.rsplit(" ", 1)[1])
        raise KeyError(name)

    def children(self) -> list[psutil.Process]:
        return psutil.Process(self.proc.pid).children(recursive=True)

    def child(self, name: str) -> psutil.Process:
        found = [p for p in self.children() if p.name() == name]
        if len(found) != 1:
            raise LookupError(f"{len(found)} children named {name!r}: {[p.name() for p in self.children()]}")
        return found[0]

    def ipc_leftovers(self) -> list[str]:
        """What the engine's ipc folders (ps-*) left in this server's TMPDIR."""
        left = []
        for root, dirs, files in os.walk(self.tmpdir):
            rel = os.path.relpath(root, self.tmpdir)
            paths = [os.path.normpath(os.path.join(rel, n)) for n in dirs + files]
            left += [p for p in paths if p.split(os.sep)[0].startswith("ps-")]
        return sorted(left)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def stop_and_check_clean(self, kids: list[psutil.Process] | None = None) -> None:
        """Stop the server; then no child may be left and no ipc file either."""
        kids = self.children() if kids is None else kids
        self.stop()
        _, alive = psutil.wait_procs(kids, timeout=15)
        for p in alive:      # do not leak them into later tests, then fail
            p.kill()
        assert not alive, f"children left after shutdown: {alive}"
        assert self.ipc_leftovers() == [], f"ipc files left after shutdown: {self.ipc_leftovers()}"
