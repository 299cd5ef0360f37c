"""engine-serve as a real subprocess (tests and the soak script): free ports, its own TMPDIR, every line it
prints kept, and the RSS and open fds of its process tree."""
from __future__ import annotations

import os
import random
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

from pagedserve.tests.helpers.processes import metrics as _metrics

API_KEY = "test-key-123"
TOKEN = "engine-token-abc"
# A Hermes (Qwen2.5-like) chat template that renders tools: the tool-calling servers' --chat-template.
HERMES_TEMPLATE = os.path.join(os.path.dirname(__file__), "..", "..", "data", "hermes_tools.jinja")
TOOL_FLAGS = ("--chat-template", HERMES_TEMPLATE, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
SMALL_KV = ("--kv-cache-memory", "0.25")      # GiB: servers that live through a module need not hold 2


def _port_range() -> range:
    """This test process's own ports: below the kernel's ephemeral range (which bind(0), every outgoing
    connection and Ray's many workers draw from, so a port picked there can be taken before the server binds
    it: CI failures of servers that could not start beside the Ray tests), one slice per xdist worker."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            ephemeral_low = int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        ephemeral_low = 32768
    low, high = 10000, max(ephemeral_low, 12000)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    index = int(worker) if worker.isdigit() else 0
    size = (high - low) // max(workers, 1)
    return range(low + index * size, low + (index + 1) * size)


def free_port(avoid: set[int] = frozenset()) -> int:
    """A loopback port free now, from this test process's own range (_port_range), not one of `avoid`."""
    ports = _port_range()
    for _ in range(1000):
        port = random.SystemRandom().choice(ports)     # not the tests' seeded generator
        if port in avoid:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free loopback port in {ports}")


def stop_process(proc: subprocess.Popen, grace_s: float = 30) -> None:
    """SIGTERM (a server's graceful stop), then SIGKILL after grace_s."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def free_port_on(hosts: list[str]) -> int:
    """A port free now on every one of these loopback addresses (127.0.0.0/8 is all loopback on Linux)."""
    while True:
        port = free_port()
        try:
            for host in hosts:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
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


def process_usage(pid: int) -> tuple[int, int]:
    """(RSS bytes, open file descriptors) of a process and all its descendants; one that exits meanwhile
    counts for nothing."""
    root = psutil.Process(pid)
    rss = fds = 0
    for p in [root, *root.children(recursive=True)]:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
        except psutil.NoSuchProcess:
            pass
    return rss, fds


class Server:
    """`engine-serve MODEL` on a free port; by default its engine core on tcp with a token.

    Its TMPDIR is a private folder, so the ipc files of the engine it starts can be checked; stdout and
    stderr of the server and all its children go to one file (a pipe nobody reads would block it).
    """

    def __init__(self, *extra: str, model: str | None = None, api_key: str | None = API_KEY,
                 token: str | None = TOKEN, log_level: str = "warning", max_model_len: int | None = 1024,
                 dtype: str | None = "float32", startup_s: float = 180, tls: tuple[str, str] | None = None,
                 host: str = "127.0.0.1", port: int | None = None) -> None:
        """api_key: None serves without one; token: the engine core's tcp token (None leaves the core on
        engine-serve's default transport). host, port: where it listens (another loopback address, with the
        same port as another server's, stands for a pod IP; free_port_on finds such a port).
        max_model_len, dtype: None leaves engine-serve's own default (the model's).
        tls: (certificate, key) files: serve HTTPS, and trust that certificate here."""
        # The engine core listens on PORT and PORT + 1.
        self.engine_port: int | None = free_port_pair() if token is not None else None
        self.port = port or free_port(avoid={self.engine_port, self.engine_port + 1} if self.engine_port else set())
        self.api_key, self.token = api_key, token
        self.url = f"{'https' if tls else 'http'}://{host}:{self.port}"
        self.verify: ssl.SSLContext | bool = ssl.create_default_context(cafile=tls[0]) if tls else True
        if tls:
            extra = (*extra, "--ssl-certfile", tls[0], "--ssl-keyfile", tls[1])
        self.tmpdir = tempfile.mkdtemp(prefix="ps-test-srv-")
        self.log_path = os.path.join(self.tmpdir, "server.log")
        cmd = [sys.executable, "-m", "pagedserve.frontend.cli", *([model] if model else []), "--port", str(self.port),
               *(["--host", host] if host != "127.0.0.1" else []),
               *(["--api-key", api_key] if api_key is not None else []), "--log-level", log_level]
        if dtype is not None:
            cmd += ["--dtype", dtype]
        if max_model_len is not None:
            cmd += ["--max-model-len", str(max_model_len)]
        if token is not None:
            cmd += ["--engine-address", f"tcp://127.0.0.1:{self.engine_port}", "--engine-token", token]
        env = dict(os.environ, TMPDIR=self.tmpdir)
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen([*cmd, *extra], stdout=log, stderr=subprocess.STDOUT, env=env)
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
        """vllm:* and pagedserve:* samples of /metrics (prefix dropped), summed over labels."""
        return _metrics.read_metrics(self.url, self.verify)

    def wait_idle(self, timeout_s: float = 30) -> dict[str, float]:
        """Metrics once nothing runs or waits and the KV pool is free, or the last reading at the timeout."""
        return _metrics.wait_idle(self.url, timeout_s, self.verify)

    def usage(self) -> tuple[int, int]:
        """(RSS bytes, open fds) of the server and all its children."""
        return process_usage(self.proc.pid)

    def health(self) -> int:
        return httpx.get(f"{self.url}/health", timeout=10, verify=self.verify).status_code

    def metric(self, name: str) -> float:
        """One vllm:* or pagedserve:* metric (prefix dropped, summed over labels); KeyError if the server does
        not export it."""
        m = self.metrics()
        if name not in m:
            raise KeyError(name)
        return m[name]

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
        stop_process(self.proc)

    def stop_and_check_clean(self, kids: list[psutil.Process] | None = None) -> None:
        """Stop the server; then no child may be left and no ipc file either."""
        kids = self.children() if kids is None else kids
        self.stop()
        _, alive = psutil.wait_procs(kids, timeout=15)
        for p in alive:      # do not leak them into later tests, then fail
            p.kill()
        assert not alive, f"children left after shutdown: {alive}"
        assert self.ipc_leftovers() == [], f"ipc files left after shutdown: {self.ipc_leftovers()}"
