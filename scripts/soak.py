"""Soak test: mixed OpenAI traffic against engine-serve for minutes to hours, checking invariants.

Starts `engine-serve` on a free loopback port (or attaches to one with --url), then alternates traffic
periods (bounded concurrency: completions and chat, streamed or not, random lengths, some n=2, some stop
strings, some clients that hang up mid-stream) with idle checkpoints. Invariants:

- every request completes with the right number of tokens (ignore_eos fixes it; a stop string may end
  it early with finish_reason "stop") or raises an explicit error; none runs past --deadline-s;
- at every idle checkpoint: GET /health is 200, /metrics shows 0 running, 0 waiting, KV cache usage 0
  (every block back in the pool), and the server's processes (frontend + engine core + workers) keep
  their RSS and open file descriptors within a tolerance of the first checkpoint.

The request mix is tests/helpers/processes/traffic.py (tests/e2e/reliability/test_load.py sends it too), the server
tests/helpers/processes/server.py's Server.

    python scripts/soak.py --minutes 12 --out benchmarks/soak_cpu.md
    python scripts/soak.py --url http://127.0.0.1:8000 --api-key KEY --minutes 60
"""
from __future__ import annotations

import argparse
import asyncio
import collections
import dataclasses
import os
import platform
import random
import statistics
import sys
import tempfile
import time

import httpx
import openai

from pagedserve.tests.helpers.processes.metrics import wait_idle
from pagedserve.tests.helpers.processes.server import Server, process_usage
from pagedserve.tests.helpers.models.tiny_models import make_tiny_serving_model
from pagedserve.tests.helpers.processes.traffic import Result, random_spec, run_one


# ---------------------------------------------------------------- the soak loop


@dataclasses.dataclass
class Checkpoint:
    at_s: float
    health: int
    running: float
    waiting: float
    kv_usage: float
    rss_mib: float | None
    fds: int | None
    requests: int


async def traffic(client: openai.AsyncOpenAI, model: str, rng: random.Random, seconds: float, concurrency: int,
                  deadline_s: float, max_tokens: int, results: list[Result]) -> None:
    stop_at = time.monotonic() + seconds

    async def worker() -> None:
        while time.monotonic() < stop_at:
            results.append(await run_one(client, random_spec(rng, max_tokens), model, deadline_s))
    await asyncio.gather(*(worker() for _ in range(concurrency)))


async def checkpoint(url: str, pid: int | None, start: float, n: int) -> Checkpoint:
    await asyncio.sleep(0.5)       # let hung-up streams' aborts reach the core
    m = await asyncio.to_thread(wait_idle, url)
    health = httpx.get(f"{url}/health", timeout=10).status_code
    rss, fds = process_usage(pid) if pid is not None else (None, None)
    return Checkpoint(time.monotonic() - start, health, m["num_requests_running"], m["num_requests_waiting"],
                      m["kv_cache_usage_perc"], rss / 2**20 if rss is not None else None, fds, n)


async def soak(args: argparse.Namespace, url: str, pid: int | None) -> tuple[list[Result], list[Checkpoint]]:
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=args.api_key, max_retries=0,
                                timeout=args.deadline_s + 30)
    model = (await client.models.list()).data[0].id
    rng = random.Random(args.seed)
    results: list[Result] = []
    checkpoints: list[Checkpoint] = []
    start = time.monotonic()
    end = start + args.minutes * 60
    while time.monotonic() < end:
        period = min(args.check_every_s, max(1.0, end - time.monotonic()))
        await traffic(client, model, rng, period, args.concurrency, args.deadline_s, args.max_tokens, results)
        checkpoints.append(await checkpoint(url, pid, start, len(results)))
        c = checkpoints[-1]
        print(f"[{c.at_s:7.0f} s] {c.requests} requests, health {c.health}, kv {c.kv_usage:.3f}, "
              f"rss {c.rss_mib or 0:.0f} MiB, fds {c.fds}", flush=True)
    await client.close()
    return results, checkpoints


# ---------------------------------------------------------------- verdict and report


def verdict(results: list[Result], checkpoints: list[Checkpoint], rss_tol_mib: float,
            fd_tol: int) -> list[str]:
    """Every broken invariant, in words; empty when the soak passed."""
    problems = []
    by = collections.Counter(r.outcome for r in results)
    if by["hung"]:
        problems.append(f"{by['hung']} requests ran past the deadline")
    if by["wrong"]:
        problems.append(f"{by['wrong']} requests completed with the wrong tokens or choices")
    for c in checkpoints:
        if c.health != 200 or c.running or c.waiting or c.kv_usage:
            problems.append(f"checkpoint at {c.at_s:.0f} s not idle/healthy: health {c.health}, running "
                            f"{c.running}, waiting {c.waiting}, kv usage {c.kv_usage}")
    measured = [c for c in checkpoints if c.rss_mib is not None]
    if len(measured) >= 3:       # the first checkpoint is the warm-up: compare the later ones to the second
        base = measured[1]
        for c in measured[2:]:
            if c.rss_mib - base.rss_mib > rss_tol_mib:
                problems.append(f"RSS grew {c.rss_mib - base.rss_mib:.0f} MiB by {c.at_s:.0f} s")
            if c.fds - base.fds > fd_tol:
                problems.append(f"open fds grew by {c.fds - base.fds} by {c.at_s:.0f} s")
    return problems


def _pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def report(args: argparse.Namespace, results: list[Result], checkpoints: list[Checkpoint],
           problems: list[str], wall_s: float) -> str:
    by = collections.Counter(r.outcome for r in results)
    ok = [r.seconds for r in results if r.outcome == "ok"]
    errors = collections.Counter(r.detail.split(":", 1)[0] + ": " + r.detail.split(":", 1)[-1][:80]
                                 for r in results if r.outcome in ("error", "wrong", "hung"))
    lines = [
        "# Soak test (scripts/soak.py)", "",
        f"`python scripts/soak.py {' '.join(sys.argv[1:])}`", "",
        f"- machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
        f"{platform.python_version()}, date {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}",
        f"- server: {args.url or 'engine-serve ' + ' '.join(args.server_args)}"
        f"{' on a random-weight tiny Llama (2 layers, hidden 64, SmolLM2 tokenizer)' if args.tiny_model else ''}",
        f"- traffic: {args.concurrency} concurrent clients (official `openai` AsyncOpenAI), completions and chat, "
        f"70% streamed, 20% n=2, 20% with a stop string, ~5% of streams hang up after 1-4 chunks, "
        f"max_tokens 1-{args.max_tokens} with ignore_eos; idle checkpoint every {args.check_every_s:.0f} s; "
        f"deadline {args.deadline_s:.0f} s per request",
        f"- ran {wall_s / 60:.1f} min: {len(results)} requests; " +
        ", ".join(f"{k} {v}" for k, v in sorted(by.items())),
        f"- latency of completed requests: p50 {_pct(ok, 0.5):.2f} s, p99 {_pct(ok, 0.99):.2f} s, "
        f"max {max(ok, default=float('nan')):.2f} s",
        "", f"**Verdict: {'PASS' if not problems else 'FAIL'}**", ""]
    lines += [f"- {p}" for p in problems]
    if errors:
        lines += ["", "Errors seen by clients (explicit, counted):", ""]
        lines += [f"- {n} × {e}" for e, n in errors.most_common(10)]
    lines += ["", "| t (s) | requests so far | /health | running | waiting | KV usage | RSS (MiB) | fds |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for c in checkpoints:
        lines.append(f"| {c.at_s:.0f} | {c.requests} | {c.health} | {c.running:.0f} | {c.waiting:.0f} | "
                     f"{c.kv_usage:.3f} | {c.rss_mib or 0:.0f} | {c.fds} |")
    if checkpoints and checkpoints[0].rss_mib is not None:
        lines += ["", "RSS and fds are summed over the frontend, the engine core and any workers; the first "
                  "checkpoint is the warm-up, growth is measured from the second."]
    if ok:
        lines += ["", f"Completed-request throughput: {len(ok) / wall_s:.2f} requests/s "
                  f"(mean {statistics.mean(ok):.2f} s each)."]
    return "\n".join(lines) + "\n"


def start_server(args: argparse.Namespace) -> Server:
    """engine-serve as the flags ask: engine-serve's own defaults (dtype, length, engine transport) except
    for what --server-args sets; the tiny model when --tiny-model."""
    model = make_tiny_serving_model(tempfile.mkdtemp(prefix="soak-tiny-")) if args.tiny_model else None
    extra = ["--max-model-len", "512", *args.server_args] if args.tiny_model else args.server_args
    return Server(*extra, model=model, api_key=args.api_key, token=None, max_model_len=None, dtype=None,
                  startup_s=300)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", default=None, help="attach to a running server instead of starting one")
    p.add_argument("--api-key", default="soak-key")
    p.add_argument("--server-args", nargs=argparse.REMAINDER, default=[],
                   help="flags for the engine-serve this script starts (must come last)")
    p.add_argument("--tiny-model", action="store_true",
                   help="serve a random-weight tiny Llama (default: the embedded SmolLM2 or --server-args' model)")
    p.add_argument("--minutes", type=float, default=10)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--deadline-s", type=float, default=120)
    p.add_argument("--check-every-s", type=float, default=60)
    p.add_argument("--rss-tolerance-mib", type=float, default=64)
    p.add_argument("--fd-tolerance", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="markdown report path (default: print)")
    args = p.parse_args()
    srv = None if args.url else start_server(args)
    url = args.url or srv.url
    start = time.monotonic()
    try:
        results, checkpoints = asyncio.run(soak(args, url, srv.proc.pid if srv else None))
    finally:
        if srv is not None:
            srv.stop()
    problems = verdict(results, checkpoints, args.rss_tolerance_mib, args.fd_tolerance)
    text = report(args, results, checkpoints, problems, time.monotonic() - start)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
