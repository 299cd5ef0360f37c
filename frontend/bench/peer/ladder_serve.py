"""The serving half of `pagedserve bench ladder`: `pagedserve bench serve` against llama-server and against
`pagedserve serve` on each ladder file, one server at a time, each rate on a freshly started server."""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator
from typing import Any

from pagedserve.frontend.bench.peer.engines import PEER
from pagedserve.frontend.bench.peer.llama_server import LlamaServer, free_port
from pagedserve.frontend.bench.results import read_results

LLAMA_PARALLEL, LLAMA_CTX = 16, 12800        # as bench peer and benchmarks/README.md's serve runs
# The `pagedserve` command of this interpreter (as .venv/bin/pagedserve is), whether or not it is installed.
PAGEDSERVE = [sys.executable, "-m", "pagedserve.frontend.pagedserve_cli"]


def serve_flags(options: dict[str, Any]) -> list[str]:
    """EngineArgs overrides as `pagedserve serve` flags (bools as --x / --no-x); an unset (None) is left to
    the server's default, which is what unset means there too."""
    from pagedserve.common.config.arg_utils import add_dataclass_args
    from pagedserve.common.config.engine_args import EngineArgs
    parser = argparse.ArgumentParser(add_help=False)
    add_dataclass_args(parser, EngineArgs)
    actions = {a.dest: a for a in parser._actions}
    flags: list[str] = []
    for key, value in options.items():
        flag = actions[key].option_strings[0]
        if isinstance(value, bool):
            if value or isinstance(actions[key], argparse.BooleanOptionalAction):
                flags.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            flags += [flag, str(value)]
    return flags


@contextlib.contextmanager
def pagedserve_server(gguf: str, threads: int, options: dict[str, Any], timeout_s: float = 900.0,
                      extra: tuple[str, ...] = ()) -> Iterator[str]:
    """`pagedserve serve` on `gguf` (or any model path) at a free port; `extra`: more of its flags."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [*PAGEDSERVE, "serve", gguf, "--host", "127.0.0.1", "--port", str(port),
           *serve_flags(options), *extra]
    with tempfile.TemporaryFile("w+") as log:
        # A session of its own: its engine core child can be found (and stopped) by the group id.
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, "OMP_NUM_THREADS": str(threads)})
        try:
            wait_health(url, proc, timeout_s, log)
            yield url
        finally:
            stop_group(proc)


def wait_health(url: str, proc: subprocess.Popen, timeout_s: float, log: Any) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"pagedserve serve exited with {proc.returncode}:\n{log.read()[-4000:]}")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url + "/health", timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(0.5)
    raise RuntimeError(f"pagedserve serve not healthy after {timeout_s:.0f} s")


def stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server (it stops its engine core), then, after a grace period, whatever is left of the
    process group it leads (only processes it started), so the next server has the cores to itself."""
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 15
    with contextlib.suppress(ProcessLookupError):
        while time.monotonic() < deadline:
            os.killpg(proc.pid, 0)                  # raises once the group is empty
            time.sleep(0.2)
        os.killpg(proc.pid, signal.SIGKILL)


@contextlib.contextmanager
def serving(engine: str, cfg: dict[str, Any]) -> Iterator[str]:
    if engine != PEER:
        with pagedserve_server(cfg["gguf"], cfg["threads"], cfg["user_options"]) as url:
            yield url
        return
    server = LlamaServer(cfg["llama_server"], cfg["gguf"], cfg["threads"], LLAMA_PARALLEL, LLAMA_CTX)
    try:
        yield server.url
    finally:
        server.stop()


def bench_serve(url: str, label: str, num_prompts: int, rates: tuple[float, ...]) -> list[dict[str, Any]]:
    """`pagedserve bench serve` on one server; its lines, read back from a file of their own."""
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "serve.jsonl")
        cmd = [*PAGEDSERVE, "bench", "serve", "--base-url", url, "--label", label,
               "--dataset-name", "w1", "--num-prompts", str(num_prompts), "--request-rate",
               *(str(r) for r in rates), "--ignore-eos", "--result-file", out]
        proc = subprocess.run(cmd, stdout=sys.stderr)       # its reports go with the progress lines
        if proc.returncode or not os.path.isfile(out):
            raise RuntimeError(f"bench serve against {label} failed (exit {proc.returncode})")
        return read_results(out)


def serve_size(args: argparse.Namespace, size: str, info: dict[str, Any], cfg: dict[str, Any],
               emit: Callable[[dict[str, Any]], None]) -> None:
    """Each rate against a fresh server: W1's prompts are the same at every rate, and a server that served them
    at the first would answer the second from its prefix cache (pagedserve) or its slots' cached prompts
    (llama-server's cache_prompt)."""
    for engine in args.engine:
        label = f"{engine} {size} {info['format']}"
        for rate in args.rates[size]:
            try:
                with serving(engine, cfg) as url:
                    lines = bench_serve(url, label, args.serve_prompts[size], (rate,))
            except Exception as exc:     # noqa: BLE001 - the offline numbers of the ladder still stand
                print(f"bench ladder: serving {label} at {rate}/s failed: {exc}", file=sys.stderr, flush=True)
                continue
            for line in lines:
                emit({**line, **info, "engine": engine, "threads": cfg["threads"]})
