"""Soak test: mixed OpenAI traffic against engine-serve for minutes to hours, checking invariants.

Starts `engine-serve` on a free loopback port (or attaches to one with --url), then alternates traffic
periods (bounded concurrency: completions and chat, streamed or not, random lengths, some n=2, some stop
strings, some clients that hang up mid-stream) with idle checkpoints. Invariants:

- every request completes with the right number of tokens (ignore_eos fixes it; a stop string may end
  it early with finish_reason "stop") or raises an explicit error; none runs past --deadline-s;
- at every idle checkpoint: GET /health is 200, /metrics shows 0 running, 0 waiting, KV cache usage 0
  (every block back in the pool), and the server's processes (frontend + engine core + workers) keep
  their RSS and open file descriptors within a tolerance of the first checkpoint.

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
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx
import openai
import psutil

STOP_STRINGS = [" the", ".", ",", "\n", " a"]
WORDS = "the quick brown fox jumps over a lazy dog while seven bakers sing about rivers and stone".split()


@dataclasses.dataclass
class Spec:
    """One request of the mix."""
    kind: str                 # "completion" | "chat"
    prompt: str
    max_tokens: int
    n: int
    stream: bool
    stop: list[str] | None
    hang_up_after: int | None     # streamed chunks read before the client disconnects; None = read all


@dataclasses.dataclass
class Result:
    spec: Spec
    outcome: str              # "ok" | "error" | "hung" | "disconnected" | "wrong"
    detail: str = ""
    seconds: float = 0.0


def random_spec(rng: random.Random, max_tokens: int = 32, disconnect_frac: float = 0.05) -> Spec:
    stream = rng.random() < 0.7
    return Spec(kind=rng.choice(["completion", "chat"]),
                prompt=" ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60))),
                max_tokens=rng.randint(1, max_tokens), n=2 if rng.random() < 0.2 else 1, stream=stream,
                stop=[rng.choice(STOP_STRINGS)] if rng.random() < 0.2 else None,
                hang_up_after=rng.randint(1, 4) if stream and rng.random() < disconnect_frac else None)


def _check_counts(spec: Spec, finish: dict[int, str | None], tokens: int) -> str | None:
    """None if the choices and token count are what the spec asks for, else what is wrong."""
    if sorted(finish) != list(range(spec.n)):
        return f"choices {sorted(finish)} for n={spec.n}"
    if any(r not in ("length", "stop") for r in finish.values()):
        return f"finish reasons {finish}"
    if spec.stop is None and any(r != "length" for r in finish.values()):
        return f"finish reasons {finish} without a stop string (ignore_eos)"
    if all(r == "length" for r in finish.values()) and tokens != spec.n * spec.max_tokens:
        return f"{tokens} tokens, expected {spec.n * spec.max_tokens}"
    if tokens > spec.n * spec.max_tokens:
        return f"{tokens} tokens, more than {spec.n * spec.max_tokens}"
    return None


def _kwargs(spec: Spec, model: str) -> dict[str, Any]:
    kw: dict[str, Any] = dict(model=model, max_tokens=spec.max_tokens, n=spec.n, temperature=0.8,
                              extra_body={"ignore_eos": True})
    if spec.stop:
        kw["stop"] = spec.stop
    if spec.stream:
        kw.update(stream=True, stream_options={"include_usage": True})
    return kw


async def _create(client: openai.AsyncOpenAI, spec: Spec, model: str) -> Any:
    if spec.kind == "completion":
        return await client.completions.create(prompt=spec.prompt, **_kwargs(spec, model))
    return await client.chat.completions.create(messages=[{"role": "user", "content": spec.prompt}],
                                                **_kwargs(spec, model))


async def _consume(spec: Spec, resp: Any) -> tuple[str, str]:
    if not spec.stream:
        finish = {c.index: c.finish_reason for c in resp.choices}
        wrong = _check_counts(spec, finish, resp.usage.completion_tokens)
        return ("wrong", wrong) if wrong else ("ok", "")
    finish: dict[int, str | None] = {}
    usage, chunks = None, 0
    try:
        async for chunk in resp:
            chunks += 1
            for c in chunk.choices:
                finish.setdefault(c.index, None)
                if c.finish_reason is not None:
                    finish[c.index] = c.finish_reason
            usage = chunk.usage or usage
            if spec.hang_up_after is not None and chunks >= spec.hang_up_after:
                return "disconnected", ""
    finally:
        await resp.close()
    if usage is None:
        return "wrong", "stream ended without usage"
    wrong = _check_counts(spec, finish, usage.completion_tokens)
    return ("wrong", wrong) if wrong else ("ok", "")


async def run_one(client: openai.AsyncOpenAI, spec: Spec, model: str, deadline_s: float) -> Result:
    """Send one request; classify how it ended. An exception from the server is an explicit error."""
    start = time.monotonic()

    async def go() -> tuple[str, str]:
        return await _consume(spec, await _create(client, spec, model))
    try:
        outcome, detail = await asyncio.wait_for(go(), deadline_s)
    except asyncio.TimeoutError:
        outcome, detail = "hung", f"no end within {deadline_s} s"
    except openai.APIStatusError as exc:
        outcome, detail = "error", f"HTTP {exc.status_code}: {str(exc)[:160]}"
    except openai.APIError as exc:
        outcome, detail = "error", f"{type(exc).__name__}: {str(exc)[:160]}"
    return Result(spec, outcome, detail, time.monotonic() - start)


# ---------------------------------------------------------------- the server and its processes


def make_tiny_model(path: str) -> str:
    """A random-weight 2-layer Llama with the embedded model's tokenizer (its full vocabulary): the serving
    machinery under many more requests than a real model allows on a small CPU."""
    import torch
    import transformers

    from pagedserve.common.model_files import resolve_model, tokenizer_folder
    from pagedserve.frontend.tokenizer import load_tokenizer
    config = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=128, vocab_size=49152,
                                      max_position_embeddings=512, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    load_tokenizer(tokenizer_folder(resolve_model(None))).save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(extra: list[str], api_key: str, timeout_s: float = 300) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "pagedserve.frontend.cli", "--port", str(port), "--api-key", api_key,
           "--log-level", "warning", *extra]
    log = tempfile.TemporaryFile(mode="w+")     # not a pipe: nobody reads it during the soak
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"engine-serve exited: {log.read()[-3000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    proc.kill()
    raise TimeoutError("engine-serve did not become healthy")


def stop_server(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def process_usage(pid: int) -> tuple[int, int]:
    """(RSS bytes, open file descriptors) of a process and all its descendants."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    rss = fds = 0
    for p in procs:
        try:
            rss += p.memory_info().rss
            fds += p.num_fds()
        except psutil.NoSuchProcess:
            pass
    return rss, fds


def read_metrics(url: str) -> dict[str, float]:
    """The pagedserve:* gauges and counters of /metrics (summed over labels)."""
    values: dict[str, float] = collections.defaultdict(float)
    for line in httpx.get(f"{url}/metrics", timeout=10).text.splitlines():
        if line.startswith("pagedserve:"):
            name = line.split("{", 1)[0].split(" ", 1)[0][len("pagedserve:"):]
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


async def wait_idle(url: str, timeout_s: float = 30) -> dict[str, float]:
    """Metrics once nothing runs or waits (KV usage is reported by the step that emptied the batch)."""
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(url)
        if m["num_requests_running"] == 0 and m["num_requests_waiting"] == 0 and m["kv_cache_usage_perc"] == 0:
            return m
        if time.monotonic() > deadline:
            return m
        await asyncio.sleep(0.2)


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
    m = await wait_idle(url)
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
    server_args = list(args.server_args)
    if args.tiny_model:
        server_args = [make_tiny_model(tempfile.mkdtemp(prefix="soak-tiny-")), "--max-model-len", "512",
                       *server_args]
    proc, url = (None, args.url) if args.url else start_server(server_args, args.api_key)
    start = time.monotonic()
    try:
        results, checkpoints = asyncio.run(soak(args, url, proc.pid if proc else None))
    finally:
        if proc is not None:
            stop_server(proc)
    problems = verdict(results, checkpoints, args.rss_tolerance_mib, args.fd_tolerance)
    text = report(args, results, checkpoints, problems, time.monotonic() - start)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    print(text)
    sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
