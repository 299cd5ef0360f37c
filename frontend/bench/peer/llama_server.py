"""llama.cpp's `llama-server` as a benchmark peer: started on a free port, fed token ids over HTTP, its peak
RSS watched, stopped. Used by `pagedserve bench peer`, `ladder` and `spec-decode`; the binary comes from the
checkout's scripts/build_llama_server.sh (find_llama_server)."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import psutil

# The checkout this package runs from (frontend/bench/peer/ -> the repository root): the build script lives in its
# scripts/, which an installed package does not have.
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
BUILD_SCRIPT = os.path.join(_ROOT, "scripts", "build_llama_server.sh")


def free_port() -> int:
    """A port the OS says is free now (another process could take it before the server binds; rare)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RssSampler:
    """Peak RSS of one process: psutil samples, and the kernel's own high-water mark (VmHWM) where Linux
    has one, which also catches a peak between two samples."""

    def __init__(self, pid: int, interval_s: float = 0.02) -> None:
        self.proc = psutil.Process(pid)
        self.interval_s = interval_s
        self.peak_bytes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        try:
            self.peak_bytes = max(self.peak_bytes, self.proc.memory_info().rss, self._hwm_bytes())
        except psutil.Error:
            pass                               # the process is gone: the last peak stands

    def _hwm_bytes(self) -> int:
        try:
            with open(f"/proc/{self.proc.pid}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except OSError:
            pass
        return 0

    def stop(self) -> float:
        """Stops sampling; the peak in MiB."""
        self.sample()
        self._stop.set()
        self._thread.join()
        return self.peak_bytes / 2**20


class LlamaServer:
    """`llama-server -m GGUF -t THREADS -np PARALLEL -c CTX --cont-batching` on a free local port."""

    def __init__(self, binary: str, gguf: str, threads: int, parallel: int, ctx: int,
                 startup_timeout_s: float = 600.0, extra_args: Sequence[str] = ()) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.parallel = parallel
        self.log = tempfile.NamedTemporaryFile(prefix="llama-server-", suffix=".log", delete=False)
        cmd = [binary, "-m", gguf, "-t", str(threads), "-np", str(parallel), "-c", str(ctx), "--cont-batching",
               "--host", "127.0.0.1", "--port", str(self.port), *extra_args]
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT)
        self.rss = RssSampler(self.proc.pid)
        try:
            self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                pass                           # 503 while the model loads, refused before it listens
            time.sleep(0.2)
        raise RuntimeError(f"llama-server not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def log_tail(self, chars: int = 4000) -> str:
        with open(self.log.name, errors="replace") as f:
            return f.read()[-chars:]

    def complete(self, prompt_ids: list[int], n_predict: int) -> dict:
        """One greedy completion of exactly `n_predict` tokens; RuntimeError if the server made another count."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "ignore_eos": True, "cache_prompt": False,
                "temperature": 0.0, "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            out = json.loads(r.read())
        got = out.get("tokens_predicted")
        if got != n_predict:
            raise RuntimeError(f"llama-server generated {got} tokens, asked for {n_predict} "
                               f"(prompt of {len(prompt_ids)} ids; stop_type {out.get('stop_type')!r})")
        return out

    def generate(self, prompt_ids: list[int], n_predict: int) -> dict:
        """One greedy completion that may stop at EOS (at most `n_predict` tokens)."""
        body = {"prompt": prompt_ids, "n_predict": n_predict, "cache_prompt": False, "temperature": 0.0,
                "stream": False}
        req = urllib.request.Request(self.url + "/completion", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=3600) as r:
            return json.loads(r.read())

    def run_batch(self, reqs: list[tuple[list[int], int]]) -> tuple[float, int]:
        """All requests at once, `parallel` in flight (one per slot); (seconds, output tokens)."""
        start = time.perf_counter()
        with ThreadPoolExecutor(max_workers=self.parallel) as pool:
            outs = list(pool.map(lambda r: self.complete(*r), reqs))
        elapsed = time.perf_counter() - start
        return elapsed, sum(o["tokens_predicted"] for o in outs)

    def single_stream(self, prompt_ids: list[int], n_out: int) -> tuple[float, float]:
        """(ms per output token from the wall-clock difference of a 1-token and a (n_out+1)-token run,
        the server's own timings.predicted_per_token_ms of the long run); the second pass of each is kept."""
        wall: dict[int, float] = {}
        own = 0.0
        for n in (1, n_out + 1, 1, n_out + 1):
            start = time.perf_counter()
            out = self.complete(prompt_ids, n)
            wall[n] = time.perf_counter() - start
            if n > 1:
                own = float(out["timings"]["predicted_per_token_ms"])
        return (wall[n_out + 1] - wall[1]) / n_out * 1e3, own

    def stop(self) -> float:
        """Stops the server; its peak RSS in MiB."""
        peak = self.rss.stop()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        os.unlink(self.log.name)
        return peak


def version(binary: str) -> str:
    """`llama-server --version`'s first line, and the sdist the sources came from when
    build_llama_server.sh built it (a build outside git reports no commit)."""
    out = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=60)
    lines = [l for l in (out.stdout + out.stderr).splitlines() if l.startswith("version")]
    text = lines[0] if lines else "version unknown"
    marker = os.path.join(os.path.dirname(binary), "..", "..", "src", ".from_sdist")
    if os.path.isfile(marker):
        with open(marker) as f:
            text += f", from {f.read().strip()}"
    return text


def find_llama_server(cache: str | None) -> str:
    """The llama-server binary that scripts/build_llama_server.sh builds, or finds already built, in `cache`
    (default PAGEDSERVE_LLAMA_CPP_DIR); SystemExit where there is no checkout to build from."""
    from pagedserve.common import envs
    if not os.path.isfile(BUILD_SCRIPT):
        raise SystemExit(f"no {BUILD_SCRIPT} (an installed package has no scripts/): build llama.cpp's "
                         "llama-server and give its path (--llama-server where the bench takes it)")
    cmd = ["bash", BUILD_SCRIPT, cache or envs.PAGEDSERVE_LLAMA_CPP_DIR]
    env = {**os.environ, "PYTHON": os.environ.get("PYTHON", sys.executable)}
    out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env, check=True)
    return out.stdout.strip().splitlines()[-1]
