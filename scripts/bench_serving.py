"""Online serving benchmark: W1 requests arriving as a Poisson process, streamed over the HTTP API.

Starts `engine-serve` on a free loopback port, then for each rate sends the W1 requests (see
bench_throughput.py) with exponential inter-arrival times and reports throughput, TTFT, inter-token
latency and end-to-end latency (p50/p99), plus the CPU seconds spent by the frontend process and by the
engine core process, to show which one is the bottleneck.

    python scripts/bench_serving.py --rates 0.5,1,inf --out benchmarks/serving_cpu.md
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import socket
import statistics
import subprocess
import sys
import time

import httpx
import psutil

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_throughput import workload_w1  # noqa: E402


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.frontend.cli", "--port", str(port), "--dtype", args.dtype,
           "--log-level", "warning"] + (["--model", args.model] if args.model else [])
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    raise TimeoutError("engine-serve did not start")


async def one_request(client: httpx.AsyncClient, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as resp:
        resp.raise_for_status()
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            elif chunk["choices"] and chunk["choices"][0]["text"]:
                times.append(time.perf_counter())
    end = time.perf_counter()
    itls = [b - a for a, b in zip(times, times[1:])]
    return {"ttft": times[0] - start if times else end - start, "e2e": end - start, "itl": itls, "tokens": tokens}


async def run_rate(url: str, reqs: list[tuple[list[int], int]], rate: float, seed: int) -> tuple[list[dict], float]:
    rng = random.Random(seed)
    limits = httpx.Limits(max_connections=len(reqs), max_keepalive_connections=len(reqs))
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        tasks = []
        start = time.perf_counter()
        for prompt, max_tokens in reqs:
            tasks.append(asyncio.create_task(one_request(client, url, prompt, max_tokens)))
            if rate != float("inf"):
                await asyncio.sleep(rng.expovariate(rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def cpu_seconds(proc: psutil.Process) -> float:
    t = proc.cpu_times()
    return t.user + t.system


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--rates", default="0.5,1,inf", help="requests per second; inf sends all at once")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    reqs = workload_w1(args.num_requests)
    server, url = start_server(args)
    lines = [f"\n### W1 over HTTP streaming, {args.num_requests} requests ({time.strftime('%Y-%m-%d')}, "
             f"{platform.machine()}, {os.cpu_count()} cores, dtype {args.dtype})\n",
             "| rate (req/s) | seconds | output tok/s | TTFT p50/p99 (s) | ITL p50/p99 (ms) | e2e p50/p99 (s) "
             "| frontend CPU s | engine core CPU s |", "|---|---|---|---|---|---|---|---|"]
    try:
        front = psutil.Process(server.pid)
        core = next(c for c in front.children(recursive=True) if c.name() == "ps-engine-core")
        for rate in [float(r) for r in args.rates.split(",")]:
            f0, c0 = cpu_seconds(front), cpu_seconds(core)
            results, elapsed = asyncio.run(run_rate(url, reqs, rate, seed=1))
            f1, c1 = cpu_seconds(front), cpu_seconds(core)
            tokens = sum(r["tokens"] for r in results)
            itl = [x for r in results for x in r["itl"]]
            ttft, e2e = [r["ttft"] for r in results], [r["e2e"] for r in results]
            line = (f"| {rate:g} | {elapsed:.1f} | {tokens / elapsed:.1f} | {pct(ttft, .5):.2f} / {pct(ttft, .99):.2f} "
                    f"| {pct(itl, .5) * 1e3:.0f} / {pct(itl, .99) * 1e3:.0f} | {pct(e2e, .5):.1f} / {pct(e2e, .99):.1f} "
                    f"| {f1 - f0:.1f} | {c1 - c0:.1f} |")
            print(line, flush=True)
            lines.append(line)
    finally:
        server.terminate()
        server.wait(30)
    table = "\n".join(lines)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write(table + "\n")


if __name__ == "__main__":
    main()
