"""IPC cost of one engine step, for 1, 64 and 256 running requests.

Scheduler outputs come from the real Scheduler and KVCacheManager fed W1-like requests (prompt 32-512
random ids, request ids as the HTTP server makes them), in two shapes: an all-decode step of N cached
requests, and a step where new requests join (the scheduler admits as many as the 2048-token budget
allows; their full prompts travel). Three measurements, each as median / p99 over many steps after a
warm-up:

- serialization alone (this process): encode + decode of ExecuteModel and of rank 0's WorkerResponse;
- the executor round trip, exactly MultiProcExecutor's path: encode ExecuteModel, BroadcastWriter to
  1 or 2 worker processes (each decodes it), rank 0 answers a ModelRunnerOutput over a PUSH/PULL
  socket, the core decodes it. This is what the engine core's busy loop waits for in every step;
- core -> frontend: the step's EngineCoreOutputs (one new token per request + scheduler stats) over the
  engine core's ROUTER socket to a DEALER client in another process (one way, timed on the shared
  monotonic clock; the output thread does this in parallel with the next step).

    python scripts/bench_ipc.py --out benchmarks/ipc_cpu.md
"""
from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import random
import statistics
import time
import uuid
from dataclasses import dataclass

import msgspec
import zmq

from pagedserve.core.block_hash import BlockHasher
from pagedserve.common.config import SchedulerConfig
from pagedserve.core.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.common.sampling_params import RequestOutputKind, SamplingParams
from pagedserve.core.scheduler import Scheduler
from pagedserve.ipc.broadcast import BroadcastReader, BroadcastWriter
from pagedserve.ipc.messages import (EngineCoreOutput, EngineCoreOutputs, ExecuteModel, ModelRunnerOutput,
                                     SchedulerOutput, SchedulerStats, WorkerInput, WorkerResponse, WorkerShutdown)
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import IpcPaths, make_socket

from bench_report import emit  # scripts/ is on sys.path when a script runs

BLOCK_SIZE = 16
MAX_NUM_BATCHED_TOKENS = 2048
VOCAB = 49152
EOS = (0,)


@dataclass
class Case:
    name: str
    num_running: int
    step: SchedulerOutput

    def describe(self) -> str:
        so = self.step
        return (f"{len(so.scheduled_new_reqs)} new + {len(so.scheduled_cached_reqs.req_ids)} cached reqs, "
                f"{so.total_num_scheduled_tokens} tokens")


# ---------------------------------------------------------------- realistic scheduler outputs


def _new_request(rng: random.Random, hasher: BlockHasher) -> Request:
    prompt = [rng.randrange(100, 49000) for _ in range(rng.randint(32, 512))]
    params = SamplingParams(temperature=0.0, max_tokens=4096, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    return Request(f"cmpl-{uuid.UUID(int=rng.getrandbits(128)).hex}-0", prompt, params, EOS, 4096, hasher)


def _fake_update(sched: Scheduler, so: SchedulerOutput, rng: random.Random) -> None:
    """What the model would answer: a token for every request whose prompt is fully computed."""
    ids = list(so.num_scheduled_tokens)
    tokens = [rng.randrange(100, 49000) if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens
              else -1 for r in ids]
    sched.update_from_output(so, ModelRunnerOutput(ids, tokens))


def _scheduler(max_seqs: int) -> Scheduler:
    config = SchedulerConfig(max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS, max_num_seqs=max_seqs,
                             max_model_len=8192, policy="fcfs", enable_chunked_prefill=True,
                             max_waiting_requests=None, async_scheduling=False)
    return Scheduler(config, KVCacheManager(40000, BLOCK_SIZE, enable_caching=True))


def _run_to_decode(sched: Scheduler, rng: random.Random, decode_steps: int) -> None:
    """Step until every request is decoding, then a few decode steps (some cross a block boundary)."""
    while any(r.num_computed_tokens < r.num_tokens - 1 for r in sched.requests.values()) or len(sched.waiting):
        _fake_update(sched, sched.schedule(), rng)
    for _ in range(decode_steps):
        _fake_update(sched, sched.schedule(), rng)


def build_cases(n: int, seed: int = 0) -> list[Case]:
    rng = random.Random(seed)
    hasher = BlockHasher(BLOCK_SIZE)
    sched = _scheduler(n)
    for _ in range(n):
        sched.add_request(_new_request(rng, hasher))
    _run_to_decode(sched, rng, decode_steps=20)
    decode = Case("decode", n, sched.schedule())

    # Mixed: N - k requests decoding while k new ones arrive; budget decides how many get in.
    k = max(1, n // 16)
    sched = _scheduler(n)
    for _ in range(n - k):
        sched.add_request(_new_request(rng, hasher))
    _run_to_decode(sched, rng, decode_steps=20)
    for _ in range(k):
        sched.add_request(_new_request(rng, hasher))
    mixed = Case(f"mixed ({k} arrive)", n, sched.schedule())
    return [decode, mixed]


def runner_output(so: SchedulerOutput, token_pool: list[int]) -> ModelRunnerOutput:
    ids = [d.req_id for d in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
    return ModelRunnerOutput(ids, token_pool[:len(ids)])


def core_outputs(so: SchedulerOutput, token_pool: list[int]) -> EngineCoreOutputs:
    ids = [d.req_id for d in so.scheduled_new_reqs] + so.scheduled_cached_reqs.req_ids
    outs = [EngineCoreOutput(request_id=rid, new_token_ids=[t], num_cached_tokens=16)
            for rid, t in zip(ids, token_pool)]
    return EngineCoreOutputs(outs, SchedulerStats(len(ids), 0, 0.31, 1200, 480, 0))


def token_pool(seed: int = 1) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(100, 49000) for _ in range(1024)]


# ---------------------------------------------------------------- timing helpers


def summary(ns: list[int]) -> tuple[float, float]:
    us = sorted(x / 1000 for x in ns)
    return statistics.median(us), us[min(len(us) - 1, int(0.99 * len(us)))]


def _nbytes(frames: list) -> int:
    return sum(f.nbytes if isinstance(f, memoryview) else len(f) for f in frames)


def bench_serialization(case: Case, iters: int, warmup: int) -> dict:
    enc, dec_in, dec_out = MsgpackEncoder(), MsgpackDecoder(WorkerInput), MsgpackDecoder(WorkerResponse)
    msg = ExecuteModel(case.step)
    resp = WorkerResponse(rank=0, kind="output", output=runner_output(case.step, token_pool()))
    times: list[int] = []
    for i in range(warmup + iters):
        t0 = time.perf_counter_ns()
        dec_in.decode(enc.encode(msg))
        dec_out.decode(enc.encode(resp))
        if i >= warmup:
            times.append(time.perf_counter_ns() - t0)
    return {"us": summary(times), "bytes": _nbytes(enc.encode(msg)), "resp_bytes": _nbytes(enc.encode(resp))}


# ---------------------------------------------------------------- executor round trip (other processes)


def worker_main(handle: bytes, rank: int, response_addr: str) -> None:
    """Mirrors executor/worker_proc.py's loop, with the model replaced by a canned ModelRunnerOutput."""
    ctx = zmq.Context()
    sock = make_socket(ctx, response_addr, zmq.PUSH, bind=False)
    reader = BroadcastReader.connect(handle, rank)
    encoder, decoder = MsgpackEncoder(), MsgpackDecoder(WorkerInput)
    pool = token_pool()
    sock.send_multipart(encoder.encode(WorkerResponse(rank=rank, kind="ready")))
    while True:
        try:
            frames = reader.recv(timeout_s=1.0)
        except TimeoutError:
            continue
        msg = decoder.decode(frames)
        if isinstance(msg, WorkerShutdown):
            break
        if isinstance(msg, ExecuteModel) and rank == 0:
            out = runner_output(msg.scheduler_output, pool)
            sock.send_multipart(encoder.encode(WorkerResponse(rank=0, kind="output", output=out)), copy=False)
    reader.close()
    sock.close(linger=1000)
    ctx.term()


class ExecutorPath:
    """The core's side of MultiProcExecutor: broadcast writer + response socket + worker processes."""

    def __init__(self, num_workers: int) -> None:
        self.paths = IpcPaths("bench")
        self.ctx = zmq.Context()
        self.responses = make_socket(self.ctx, self.paths.new("resp"), zmq.PULL, bind=True)
        self.writer = BroadcastWriter(num_readers=num_workers, max_message_bytes=64 << 20)
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder(WorkerResponse)
        handle = msgspec.msgpack.encode(self.writer.handle())
        addr = self.responses.getsockopt_string(zmq.LAST_ENDPOINT)
        spawn = multiprocessing.get_context("spawn")
        self.procs = [spawn.Process(target=worker_main, args=(handle, r, addr), daemon=True)
                      for r in range(num_workers)]
        for p in self.procs:
            p.start()
        for _ in self.procs:
            self._recv()

    def _recv(self) -> WorkerResponse:
        while not self.responses.poll(50):    # MultiProcExecutor polls in 50 ms slices too
            if not all(p.is_alive() for p in self.procs):
                raise RuntimeError("a benchmark worker died")
        return self.decoder.decode(self.responses.recv_multipart(copy=False))

    def step(self, so: SchedulerOutput) -> ModelRunnerOutput:
        self.writer.broadcast(self.encoder.encode(ExecuteModel(so)), timeout_s=60.0)
        resp = self._recv()
        assert resp.output is not None
        return resp.output

    def close(self) -> None:
        self.writer.broadcast(self.encoder.encode(WorkerShutdown()), timeout_s=5.0)
        for p in self.procs:
            p.join(10)
        self.writer.close()
        self.responses.close(linger=0)
        self.ctx.term()
        self.paths.close()


def bench_executor(path: ExecutorPath, case: Case, iters: int, warmup: int) -> tuple[float, float]:
    expected = len(case.step.num_scheduled_tokens)
    times: list[int] = []
    for i in range(warmup + iters):
        t0 = time.perf_counter_ns()
        out = path.step(case.step)
        t1 = time.perf_counter_ns()
        if len(out.req_ids) != expected:
            raise RuntimeError("worker answered for the wrong requests")
        if i >= warmup:
            times.append(t1 - t0)
    return summary(times)


# ---------------------------------------------------------------- core -> frontend outputs


def frontend_main(addr: str, identity: bytes, n_msgs: int) -> None:
    """A DEALER client like core_client's: decode each EngineCoreOutputs, stamp it, acknowledge."""
    ctx = zmq.Context()
    sock = make_socket(ctx, addr, zmq.DEALER, bind=False, identity=identity)
    decoder = MsgpackDecoder(EngineCoreOutputs)
    sock.send(b"hello")
    stamps: list[int] = []
    for _ in range(n_msgs):
        decoder.decode(sock.recv_multipart(copy=False))
        stamps.append(time.perf_counter_ns())
        sock.send(b"ack")
    sock.send(msgspec.msgpack.encode(stamps))
    sock.close(linger=2000)
    ctx.term()


def bench_core_to_frontend(cases: list[Case], iters: int, warmup: int) -> dict[tuple[int, str], tuple[float, float]]:
    """One way, encode -> ROUTER send -> DEALER recv -> decode; perf_counter is CLOCK_MONOTONIC (shared)."""
    pool = token_pool()
    paths = IpcPaths("bench")
    ctx = zmq.Context()
    router = make_socket(ctx, paths.new("out"), zmq.ROUTER, bind=True)
    per_case = warmup + iters
    identity = uuid.uuid4().bytes
    proc = multiprocessing.get_context("spawn").Process(
        target=frontend_main, args=(router.getsockopt_string(zmq.LAST_ENDPOINT), identity, per_case * len(cases)),
        daemon=True)
    proc.start()
    client, _ = router.recv_multipart()
    encoder = MsgpackEncoder()
    sent: list[int] = []
    for case in cases:
        msg = core_outputs(case.step, pool)
        for _ in range(per_case):
            sent.append(time.perf_counter_ns())
            router.send_multipart([client, *encoder.encode(msg)], copy=False)
            router.recv_multipart()
    stamps = msgspec.msgpack.decode(router.recv_multipart()[1])
    proc.join(10)
    router.close(linger=0)
    ctx.term()
    paths.close()
    results = {}
    for i, case in enumerate(cases):
        lo = i * per_case + warmup
        results[(case.num_running, case.name)] = summary([b - a for a, b in zip(sent[lo:lo + iters],
                                                                                stamps[lo:lo + iters])])
    return results


# ---------------------------------------------------------------- report


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def run(args: argparse.Namespace) -> str:
    sizes = [int(x) for x in args.sizes.split(",")]
    load_before = load()
    cases = [c for n in sizes for c in build_cases(n)]
    ser = {(c.num_running, c.name): bench_serialization(c, args.iters, args.warmup) for c in cases}
    rtt: dict[tuple[int, int, str], tuple[float, float]] = {}
    for workers in (1, 2):
        path = ExecutorPath(workers)
        try:
            for c in cases:
                rtt[(workers, c.num_running, c.name)] = bench_executor(path, c, args.iters, args.warmup)
        finally:
            path.close()
    front = bench_core_to_frontend(cases, args.iters, args.warmup)
    return report(args, cases, ser, rtt, front, load_before, load())


def report(args, cases, ser, rtt, front, load_before: str, load_after: str) -> str:
    lines = [f"\n### IPC per engine step ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
             f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, "
             f"pyzmq {zmq.pyzmq_version()}, msgspec {msgspec.__version__})\n",
             f"{args.iters} timed steps per row after {args.warmup} warm-up steps; µs as median / p99. "
             f"Load average (1/5/15 min) before: {load_before}; after: {load_after}.\n",
             "| running | step | request→workers bytes | serialize only | round trip, 1 worker | "
             "round trip, 2 workers | core→frontend outputs | < 1 ms? |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cases:
        key = (c.num_running, c.name)
        s, r1, r2, f = ser[key], rtt[(1,) + key], rtt[(2,) + key], front[key]
        ok = "yes" if max(r1[0], r2[0]) < 1000 else "no"
        lines.append(f"| {c.num_running} | {c.name}: {c.describe()} | {s['bytes']:,} (+{s['resp_bytes']:,} back) | "
                     f"{s['us'][0]:.0f} / {s['us'][1]:.0f} | {r1[0]:.0f} / {r1[1]:.0f} | "
                     f"{r2[0]:.0f} / {r2[1]:.0f} | {f[0]:.0f} / {f[1]:.0f} | {ok} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="1,64,256", help="numbers of running requests")
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--out", default=None, help="append the table to this markdown file")
    args = p.parse_args()
    table = run(args)
    emit(table, args.out)


if __name__ == "__main__":
    main()
