"""Online serving benchmark: W1 requests arriving as a Poisson process, streamed over the HTTP API.

Starts `engine-serve` on a free loopback port, then for each rate sends the W1 requests (see
bench_throughput.py) with exponential inter-arrival times and reports throughput, TTFT, inter-token
latency and end-to-end latency (p50/p99), plus the CPU seconds spent by the frontend process and by the
engine core process, to show which one is the bottleneck. Before the server starts, the same requests
run offline (`LLM.generate`, bench_throughput.py's child) with the same scheduler settings, so that the
highest rate can be compared with the offline throughput of the same run.

    python scripts/bench_serving.py --dtype float32 --rates 0.5,1,inf --out benchmarks/serving_cpu.md
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time

import httpx
import psutil

from bench_report import emit  # scripts/ is on sys.path when a script runs
from bench_throughput import workload_w1

from pagedserve.tests.helpers.server import free_port


def engine_flags(args: argparse.Namespace) -> list[str]:
    """Scheduler settings shared by the server and the offline run, so the two compare like for like."""
    return (["--dtype", args.dtype, "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens",
             str(args.max_num_batched_tokens)] + (["--model", args.model] if args.model else []))


def run_offline(args: argparse.Namespace) -> dict:
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_throughput.py")
    cmd = [sys.executable, script, "--child", "pagedserve", "--num-requests", str(args.num_requests)]
    proc = subprocess.run(cmd + engine_flags(args), capture_output=True, text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode or not lines:
        sys.exit(f"offline run failed:\n{proc.stderr[-4000:]}")
    return json.loads(lines[-1][len("RESULT "):])


def start_server(args: argparse.Namespace) -> tuple[subprocess.Popen, str]:
    port = free_port()
    # Every rate sends the same W1 prompts: without prefix caching, a later rate cannot reuse an earlier
    # rate's KV blocks (the offline run, one pass over distinct random prompts, gets no hits either).
    cmd = [sys.executable, "-m", "pagedserve.frontend.cli", "--port", str(port), "--log-level", "warning",
           "--no-enable-prefix-caching"]
    cmd += engine_flags(args)
    log = tempfile.TemporaryFile("w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 900     # a loaded shared machine can take minutes to load the model
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            sys.exit(f"engine-serve exited with code {proc.returncode}:\n{log.read()[-4000:]}")
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


def load() -> str:
    return " / ".join(f"{x:.1f}" for x in os.getloadavg())


def measure_rate(url: str, reqs: list[tuple[list[int], int]], rate: float, procs: dict[str, psutil.Process]) -> dict:
    """One rate: latencies from the client's view, CPU seconds of each process over the same window."""
    before = {name: cpu_seconds(proc) for name, proc in procs.items()}
    load_before = load()
    results, elapsed = asyncio.run(run_rate(url, reqs, rate, seed=1))
    cpu = {name: cpu_seconds(proc) - before[name] for name, proc in procs.items()}
    tokens = sum(r["tokens"] for r in results)
    if tokens != sum(m for _, m in reqs):
        raise RuntimeError(f"the server returned {tokens} tokens, expected {sum(m for _, m in reqs)}")
    return {"rate": rate, "seconds": elapsed, "tok_per_s": tokens / elapsed, "cpu": cpu,
            "ttft": [r["ttft"] for r in results], "e2e": [r["e2e"] for r in results],
            "itl": [x for r in results for x in r["itl"]], "load": f"{load_before} → {load()}"}


def format_row(m: dict) -> str:
    ttft, itl, e2e, cpu, sec = m["ttft"], m["itl"], m["e2e"], m["cpu"], m["seconds"]
    return (f"| {m['rate']:g} | {sec:.1f} | {m['tok_per_s']:.1f} | {pct(ttft, .5):.2f} / {pct(ttft, .99):.2f} "
            f"| {pct(itl, .5) * 1e3:.0f} / {pct(itl, .99) * 1e3:.0f} | {pct(e2e, .5):.1f} / {pct(e2e, .99):.1f} "
            f"| {cpu['frontend']:.1f} ({cpu['frontend'] / sec:.0%}) | {cpu['core']:.1f} ({cpu['core'] / sec:.0%}) "
            f"| {cpu['client']:.1f} ({cpu['client'] / sec:.0%}) | {m['load']} |")


def offline_line(offline: dict, serving: dict) -> str:
    ratio = serving["tok_per_s"] / offline["tok_per_s"]
    return (f"Offline W1 (`LLM.generate`, engine core in-process, same settings): {offline['output_tokens']} tokens "
            f"in {offline['seconds']:.1f} s = {offline['tok_per_s']:.1f} tok/s; serving at rate {serving['rate']:g} "
            f"right after it: {serving['tok_per_s']:.1f} tok/s = {ratio:.2f}x offline.")


def run_all(args: argparse.Namespace) -> list[str]:
    reqs = workload_w1(args.num_requests)
    load_start = load()
    offline = run_offline(args) if not args.skip_offline else None
    lines = [f"\n### W1 over HTTP streaming, {args.num_requests} requests "
             f"({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {platform.machine()}, {os.cpu_count()} cores, "
             f"dtype {args.dtype}, max_num_seqs {args.max_num_seqs}, "
             f"max_num_batched_tokens {args.max_num_batched_tokens})\n",
             f"Load average (1 / 5 / 15 min) at the start: {load_start}.\n",
             "| rate (req/s) | seconds | output tok/s | TTFT p50/p99 (s) | ITL p50/p99 (ms) | e2e p50/p99 (s) "
             "| frontend CPU s (% of wall) | engine core CPU s | bench client CPU s | load 1/5/15 before → after |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    server, url = start_server(args)
    pairs: list[tuple[dict, dict]] = []
    try:
        front = psutil.Process(server.pid)
        core = next(c for c in front.children(recursive=True) if c.name() == "ps-engine-core")
        procs = {"frontend": front, "core": core, "client": psutil.Process()}
        rates = [float(r) for r in args.rates.split(",")]
        for rate in rates:
            measured = measure_rate(url, reqs, rate, procs)
            lines.append(format_row(measured))
            print(lines[-1], flush=True)
        if offline is not None:
            pairs.append((offline, measured))     # the last (highest) rate against the first offline run
        # Alternate offline and serving at the highest rate, so that slow drifts of the machine hit both.
        for _ in range(args.repeat - 1):
            offline = run_offline(args)
            pairs.append((offline, measure_rate(url, reqs, rates[-1], procs)))
            lines.append(format_row(pairs[-1][1]))
            print(lines[-1], flush=True)
    finally:
        server.terminate()
        server.wait(30)
    lines.append("")
    lines += [offline_line(o, s) for o, s in pairs]
    if pairs:
        ratios = sorted(s["tok_per_s"] / o["tok_per_s"] for o, s in pairs)
        median = statistics.median(ratios)
        lines.append(f"\nServing / offline over {len(pairs)} alternating pair(s): median {median:.2f}x, range "
                     f"{ratios[0]:.2f}–{ratios[-1]:.2f}x (target >= 0.90x: {'met' if median >= 0.9 else 'missed'}).")
    lines.append(f"Load average at the end: {load()}.")
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--rates", default="0.5,1,inf", help="requests per second; inf sends all at once")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--skip-offline", action="store_true", help="do not run the offline comparison first")
    p.add_argument("--repeat", type=int, default=1,
                   help="offline / highest-rate pairs to measure (the first is the normal run; more alternate)")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    table = "\n".join(run_all(args))
    emit(table, args.out)


if __name__ == "__main__":
    main()
