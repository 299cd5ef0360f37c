"""Data-parallel routing (issue 27): `engine-serve --data-parallel-size 2` with `--data-parallel-routing prefix`
against `least-loaded` (vLLM's rule), same run, alternated and repeated, on a shared-system-prompt workload:
K system prompts of a few hundred tokens, each request one of them plus a short question, arriving as a
Poisson process. Reports the engines' prefix-cache hit rate (from /metrics) and client-side TTFT percentiles
(streamed chat completions through the openai client).

Usage: python scripts/bench_dp_routing.py [--model MODEL] [--num-requests 48] [--systems 6] [--rate 3]
           [--repeats 2] [--result-file benchmarks/results/dp_routing.jsonl]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import openai

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_child import emit  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(model: str | None, routing: str, port: int, log: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "pagedserve.frontend.cli", *([model] if model else []), "--port", str(port),
           "--data-parallel-size", "2", "--data-parallel-routing", routing, "--max-model-len", "2048",
           "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"engine-serve exited: {open(log).read()[-2000:]}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return proc
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("engine-serve did not become healthy")


def _workload(num: int, systems: int, rate: float, seed: int) -> list[tuple[float, list[dict[str, str]]]]:
    rng = random.Random(seed)
    prompts = [f"You are assistant number {i}. " + " ".join(
        f"Rule {i}.{j}: answer politely, briefly, and never mention rule {j + 1} of set {i}." for j in range(20))
        for i in range(systems)]
    t, out = 0.0, []
    for k in range(num):
        t += rng.expovariate(rate)
        out.append((t, [{"role": "system", "content": prompts[rng.randrange(systems)]},
                        {"role": "user", "content": f"Question {k}: name a colour."}]))
    return out


async def _drive(port: int, work: list[tuple[float, list[dict[str, str]]]]) -> list[float]:
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    model = (await client.models.list()).data[0].id
    start = time.perf_counter()

    async def one(at: float, messages: list[dict[str, str]]) -> float:
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        stream = await client.chat.completions.create(model=model, messages=messages, max_tokens=16,
                                                      temperature=0.0, stream=True)
        first = None
        async for chunk in stream:      # the first chunk carries only the role: time the first text
            if first is None and chunk.choices and chunk.choices[0].delta.content:
                first = time.perf_counter() - sent
        return first if first is not None else float("nan")
    try:
        return list(await asyncio.gather(*(one(at, m) for at, m in work)))
    finally:
        await client.close()


def _hit_rate(port: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    for line in httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text.splitlines():
        for name in ("vllm:prefix_cache_hits_total", "vllm:prefix_cache_queries_total"):
            if line.startswith(name + "{"):
                totals[name] = totals.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    hits, queries = totals.get("vllm:prefix_cache_hits_total", 0.0), totals.get("vllm:prefix_cache_queries_total", 0.0)
    return {"prefix_cache_hits": hits, "prefix_cache_queries": queries, "hit_rate": hits / queries if queries else 0.0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="default: the embedded model")
    parser.add_argument("--num-requests", type=int, default=48)
    parser.add_argument("--systems", type=int, default=6)
    parser.add_argument("--rate", type=float, default=3.0, help="requests per second (Poisson)")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    work = _workload(args.num_requests, args.systems, args.rate, seed=0)
    for repeat in range(args.repeats):
        for routing in ("prefix", "least-loaded"):
            port = _free_port()
            log = os.path.join(tempfile.mkdtemp(prefix="dp-bench-"), "server.log")
            proc = _start(args.model, routing, port, log)
            try:
                ttft = sorted(asyncio.run(_drive(port, work)))
                time.sleep(1.5)          # the engines' last stats reach /metrics
                result = {"routing": routing, "repeat": repeat, **_hit_rate(port),
                          "ttft_p50_s": statistics.median(ttft), "ttft_p90_s": ttft[int(0.9 * (len(ttft) - 1))],
                          "ttft_p99_s": ttft[int(0.99 * (len(ttft) - 1))], "ttft_mean_s": statistics.fmean(ttft),
                          "num_requests": args.num_requests, "systems": args.systems, "rate": args.rate,
                          "date": time.strftime("%Y-%m-%dT%H:%M:%S"), "command": " ".join(sys.argv)}
            finally:
                proc.terminate()
                proc.wait(60)
            emit(result, args.result_file)


if __name__ == "__main__":
    main()
