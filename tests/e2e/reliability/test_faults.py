"""Process faults under streaming load: a killed worker, a killed engine core, a stopped (hung) worker.

Each fault runs against a real `engine-serve --tensor-parallel-size 2` on a tiny random model while
streams are open. What must hold: every open stream ends with an error within the documented bound,
/health turns 503, and once the server exits no child process and no ipc file is left.

Bounds, measured from the fault (generous: CI shares two cores):
- SIGKILL of a worker: seen through its process sentinel at once; streams fail within KILL_BOUND_S.
- SIGKILL of the engine core: the frontend polls the core process every 0.1 s; within KILL_BOUND_S.
- SIGSTOP of a worker: its heartbeat stops; the engine fails after `--worker-heartbeat-timeout` T,
  never before T minus one heartbeat interval, and streams fail within T + KILL_BOUND_S.
- SIGSTOP then SIGCONT shorter than T minus one interval: nothing fails, every stream completes.
- SIGSTOP of the engine core: it stops beating; after `--engine-heartbeat-timeout` T every client of it
  (the server, and an AsyncEngineClient.connect from here) declares it dead, streams fail within
  T + KILL_BOUND_S and /health turns 503. A pause shorter than T minus one beat is survived.
"""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import time
from collections.abc import Callable

import httpx
import psutil
import pytest
import zmq

from pagedserve.common.config.engine_args import CORE_HEARTBEAT_INTERVAL_S, EngineArgs
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.backends import get_executor_class
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.executor.procs.heartbeat import heartbeat_interval
from pagedserve.executor.procs.multiproc_executor import WorkerDiedError
from pagedserve.frontend.client.async_client import AsyncEngineClient
from pagedserve.frontend.client.core_client import EngineDeadError
from pagedserve.ipc.messages import EngineCoreOutputs, EngineCoreRequest, UtilityCall
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.tests.helpers.processes.server import Server

HEARTBEAT_S = 3.0
KILL_BOUND_S = 5.0
TP2 = ("--tensor-parallel-size", "2", "--kv-cache-memory", "0.02", "--worker-heartbeat-timeout", str(HEARTBEAT_S))


@dataclasses.dataclass
class StreamResult:
    chunks: int = 0
    error: str | None = None
    usage: dict | None = None
    ended_at: float = 0.0


async def stream_completion(srv: Server, started: asyncio.Event, max_tokens: int, seed: int) -> StreamResult:
    """One raw SSE stream of token-id prompts (the tiny model's vocabulary is 512 ids)."""
    body = {"prompt": [5 + seed, 6, 7, 8], "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
            "temperature": 0, "stream_options": {"include_usage": True}}
    result = StreamResult()
    async with httpx.AsyncClient(timeout=120) as client:
        async with client.stream("POST", f"{srv.url}/v1/completions", json=body, headers=srv.auth) as resp:
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[len("data: "):])
                if "error" in event:
                    result.error = event["error"]["message"]
                elif event.get("usage"):
                    result.usage = event["usage"]
                else:
                    result.chunks += 1
                    started.set()
    result.ended_at = time.monotonic()
    return result


async def streams_through(srv: Server, fault: Callable[[], None], n: int = 4, max_tokens: int = 900,
                          timeout_s: float = 60) -> tuple[list[StreamResult], float]:
    """Open n streams, apply the fault once all are producing tokens; (results, when the fault hit)."""
    events = [asyncio.Event() for _ in range(n)]
    tasks = [asyncio.create_task(stream_completion(srv, ev, max_tokens, i)) for i, ev in enumerate(events)]
    await asyncio.wait_for(asyncio.gather(*(ev.wait() for ev in events)), timeout=60)
    fault_at = time.monotonic()
    fault()
    return await asyncio.wait_for(asyncio.gather(*tasks), timeout=timeout_s), fault_at


def assert_all_failed(results: list[StreamResult], fault_at: float, match: str, bound_s: float) -> float:
    """Every stream ended with an error containing `match` within bound_s; the slowest, in seconds."""
    assert all(r.error is not None for r in results), f"a stream ended without an error: {results}"
    assert all(match in r.error for r in results), [r.error for r in results]
    slowest = max(r.ended_at - fault_at for r in results)
    assert slowest <= bound_s, f"streams failed {slowest:.1f} s after the fault (bound {bound_s} s)"
    return slowest


def wait_health_503(srv: Server, timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while srv.health() != 503:
        assert time.monotonic() < deadline, "/health did not turn 503"
        time.sleep(0.1)


def test_sigkill_worker(tiny_llama_dir):
    srv = Server(*TP2, model=tiny_llama_dir)
    kids = srv.children()
    try:
        victim = srv.child("ps-worker-1")
        results, fault_at = asyncio.run(streams_through(srv, lambda: os.kill(victim.pid, signal.SIGKILL)))
        assert_all_failed(results, fault_at, "worker rank 1 died", KILL_BOUND_S)
        wait_health_503(srv)
    finally:
        srv.stop_and_check_clean(kids)


def test_sigkill_engine_core(tiny_llama_dir):
    srv = Server(*TP2, model=tiny_llama_dir)
    kids = srv.children()     # now: the workers stop being the server's descendants once the core is gone
    workers = [p for p in kids if p.name().startswith("ps-worker")]
    try:
        core = srv.child("ps-engine-core")
        results, fault_at = asyncio.run(streams_through(srv, lambda: os.kill(core.pid, signal.SIGKILL)))
        assert_all_failed(results, fault_at, "engine core process died", KILL_BOUND_S)
        wait_health_503(srv)
        # Its workers follow it (PR_SET_PDEATHSIG), before the server is even stopped.
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert len(workers) == 2 and not alive, alive
    finally:
        srv.stop_and_check_clean(kids)


class RawEngineClient:
    """A second client of the engine core, speaking the wire protocol itself."""

    def __init__(self, input_address: str, output_address: str, token: str) -> None:
        self.ctx = zmq.Context()
        self.input = self.ctx.socket(zmq.DEALER)
        self.output = self.ctx.socket(zmq.DEALER)
        for sock in (self.input, self.output):
            sock.setsockopt(zmq.IDENTITY, os.urandom(16))
            sock.setsockopt(zmq.LINGER, 0)
        self.output.setsockopt(zmq.IDENTITY, self.input.getsockopt(zmq.IDENTITY))
        self.input.connect(input_address)
        self.output.connect(output_address)
        self.token = token.encode()
        self.encoder, self.decoder = MsgpackEncoder(), MsgpackDecoder(EngineCoreOutputs)

    @classmethod
    def of(cls, srv: Server) -> "RawEngineClient":
        return cls(f"tcp://127.0.0.1:{srv.engine_port}", f"tcp://127.0.0.1:{srv.engine_port + 1}", srv.token)

    def send(self, msg: object) -> None:
        self.input.send_multipart([self.token, *self.encoder.encode(msg)])

    def recv_until(self, done: Callable[[EngineCoreOutputs], bool], timeout_s: float) -> EngineCoreOutputs:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.output.poll(100):
                out = self.decoder.decode(self.output.recv_multipart())
                if done(out):
                    return out
            elif not self.output.poll(0):
                self.send(UtilityCall(0, "ping"))    # until the core's output socket knows this peer
        raise TimeoutError("no such answer from the engine core")

    def close(self) -> None:
        self.input.close()
        self.output.close()
        self.ctx.term()


def test_sigstop_worker_short_pause_survives_long_one_fails(tiny_llama_dir):
    srv = Server(*TP2, model=tiny_llama_dir)
    kids = srv.children()
    engine_procs = [p for p in kids if p.name().startswith("ps-")]
    other = RawEngineClient.of(srv)
    try:
        other.recv_until(lambda out: bool(out.utility_results), timeout_s=30)
        # A pause well inside the timeout: the streams stall, then finish with every token.
        pause_s = HEARTBEAT_S - heartbeat_interval(HEARTBEAT_S) - 1.4
        rank1 = srv.child("ps-worker-1")

        def pause() -> None:
            rank1.suspend()
            time.sleep(pause_s)
            rank1.resume()
        results, _ = asyncio.run(streams_through(srv, pause, max_tokens=16))
        assert [r.error for r in results] == [None] * 4
        assert [r.usage["completion_tokens"] for r in results] == [16] * 4
        assert srv.health() == 200

        # Rank 0 this time, and for good: the heartbeat timeout ends the engine, not before.
        rank0 = srv.child("ps-worker-0")
        other.send(EngineCoreRequest("other-client", [9, 9, 9], SamplingParams(max_tokens=900, ignore_eos=True),
                                     time.time()))
        results, fault_at = asyncio.run(streams_through(srv, rank0.suspend, timeout_s=HEARTBEAT_S + 30))
        slowest = assert_all_failed(results, fault_at, "worker rank 0 stopped responding",
                                    HEARTBEAT_S + KILL_BOUND_S)
        earliest = min(r.ended_at - fault_at for r in results)
        assert earliest >= HEARTBEAT_S - heartbeat_interval(HEARTBEAT_S) - 0.1, (earliest, slowest)
        wait_health_503(srv)
        # The other client of the core hears it too: its request fails, and the core's last words.
        dead = other.recv_until(lambda out: out.engine_dead is not None, timeout_s=10)
        assert "worker rank 0 stopped responding" in dead.engine_dead
        assert [(o.request_id, o.finish_reason) for o in dead.outputs] == [("other-client", "error")]
        # The core exits and kills the stopped rank with it, before the server is stopped.
        _, alive = psutil.wait_procs(engine_procs, timeout=10)
        assert all(p.status() == psutil.STATUS_ZOMBIE for p in alive), alive    # exited, not yet reaped
    finally:
        other.close()
        srv.stop_and_check_clean(kids)


def test_sigstop_sole_worker_tp1(tiny_llama_dir):
    """TP=1 with a worker process: the executor itself names the silent rank within the timeout."""
    timeout_s = 2.0
    config = EngineArgs(model=tiny_llama_dir, dtype="float32", kv_cache_memory=0.02, tensor_parallel_size=1,
                        distributed_executor_backend="mp", worker_heartbeat_timeout=timeout_s).create_engine_config()
    core = EngineCore(config, get_executor_class(config.parallel.distributed_executor_backend))
    worker = max(psutil.Process().children(), key=lambda p: p.create_time())     # the one the core just started
    roots = [core.executor.bound.root, core.executor.writer.bound.root]
    try:
        core.add_request(EngineCoreRequest("a", [5, 6, 7], SamplingParams(max_tokens=500, ignore_eos=True), 0.0))
        core.step()
        worker.suspend()
        stopped_at = time.monotonic()
        with pytest.raises(WorkerDiedError, match="worker rank 0 stopped responding"):
            while time.monotonic() - stopped_at < 30:
                core.step()
        detected = time.monotonic() - stopped_at
        assert timeout_s - heartbeat_interval(timeout_s) - 0.1 <= detected <= timeout_s + KILL_BOUND_S, detected
    finally:
        core.shutdown()
    assert not worker.is_running() or worker.status() == psutil.STATUS_ZOMBIE
    assert not any(os.path.exists(r) for r in roots)


async def stop_core_under_load(srv: Server, core: psutil.Process) -> tuple[list[StreamResult], float, str, float]:
    """HTTP streams plus a generation of an AsyncEngineClient.connect client in this process, then the core
    is stopped: (stream results, when it stopped, the connected client's error, when that came)."""
    client = await AsyncEngineClient.connect(f"tcp://127.0.0.1:{srv.engine_port}", srv.token,
                                             heartbeat_timeout_s=HEARTBEAT_S)
    started = asyncio.Event()

    async def consume() -> tuple[str, float]:
        try:
            async for _ in client.generate([9, 9, 9], SamplingParams(max_tokens=900, ignore_eos=True)):
                started.set()
        except EngineDeadError as exc:
            return str(exc), time.monotonic()
        return "finished without an error", time.monotonic()
    task = asyncio.create_task(consume())
    try:
        await asyncio.wait_for(started.wait(), 60)
        results, fault_at = await streams_through(srv, core.suspend, timeout_s=HEARTBEAT_S + 30)
        error, ended_at = await asyncio.wait_for(task, 30)
        return results, fault_at, error, ended_at - fault_at
    finally:
        task.cancel()
        client.shutdown()


def test_sigstop_engine_core(tiny_llama_dir):
    """A stopped core is alive to its parent's sentinel; only its silence shows, to every client."""
    srv = Server("--kv-cache-memory", "0.02", "--engine-heartbeat-timeout", str(HEARTBEAT_S), model=tiny_llama_dir)
    kids = srv.children()
    core = srv.child("ps-engine-core")
    try:
        def pause() -> None:
            core.suspend()
            time.sleep(HEARTBEAT_S - CORE_HEARTBEAT_INTERVAL_S - 1.0)
            core.resume()
        results, _ = asyncio.run(streams_through(srv, pause, max_tokens=16))
        assert [r.error for r in results] == [None] * 4
        assert [r.usage["completion_tokens"] for r in results] == [16] * 4

        results, fault_at, error, detected = asyncio.run(stop_core_under_load(srv, core))
        assert_all_failed(results, fault_at, "sent nothing for", HEARTBEAT_S + KILL_BOUND_S)
        assert min(r.ended_at - fault_at for r in results) >= HEARTBEAT_S - 0.1
        assert "sent nothing for" in error and HEARTBEAT_S - 0.1 <= detected <= HEARTBEAT_S + KILL_BOUND_S, \
            (error, detected)
        wait_health_503(srv)
    finally:
        core.resume()
        srv.stop_and_check_clean(kids)


def test_core_beats_live_clients_and_forgets_departed_ones(tiny_llama_dir, monkeypatch):
    """In-process core with short keepalive/expiry: a listening client keeps itself alive (and hears beats
    while idle); one that left stops getting stats and beats once expired, instead of one per step forever."""
    import threading

    import pagedserve.core.engine_core_proc as core_proc
    import pagedserve.frontend.client.core_client as core_client
    from pagedserve.ipc.sockets import IpcPaths
    monkeypatch.setattr(core_proc, "CLIENT_EXPIRY_S", 2.0)
    monkeypatch.setattr(core_client, "CLIENT_KEEPALIVE_S", 0.5)
    config = EngineArgs(model=tiny_llama_dir, dtype="float32", kv_cache_memory=0.02).create_engine_config()
    paths = IpcPaths("beat")
    addresses = core_proc.CoreAddresses(input=paths.new("in"), output=paths.new("out"), handshake="")
    ctx = zmq.Context()
    proc = core_proc.EngineCoreProc(EngineCore(config, get_executor_class("uni")), ctx, addresses, "tok")
    runner = threading.Thread(target=proc.run, daemon=True)
    runner.start()
    live = core_client.SyncMPClient(addresses, "tok", heartbeat_timeout_s=3.0)
    gone = RawEngineClient(addresses.input, addresses.output, "tok")     # pings once, then never again
    identity = gone.input.getsockopt(zmq.IDENTITY)
    try:
        gone.recv_until(lambda out: bool(out.utility_results), timeout_s=30)
        deadline = time.monotonic() + 5.0          # idle, listening: only beats and keepalive answers arrive
        heard = 0
        while time.monotonic() < deadline:
            heard += live.get_output(timeout_s=0.5) is not None
        assert live.dead is None and heard >= 4, heard
        assert identity not in proc._live_clients() and live.identity in proc._live_clients()
        assert identity not in proc.clients                       # pruned on a later message
        while gone.output.poll(0):                                 # what it got before it expired
            gone.output.recv_multipart()
        # Work for the live client: every step sends stats, but never to the departed client.
        live.add_request(EngineCoreRequest("r", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True), 0.0))
        outs = []
        while not any(o.finished for o in outs):
            step = live.get_output(timeout_s=5)
            outs += step.outputs if step else []
        assert sum(len(o.new_token_ids) for o in outs) == 8
        assert not gone.output.poll(1500), "a departed client still gets messages"
    finally:
        gone.close()
        live.close()
        proc._stop.set()
        runner.join(10)
        assert not runner.is_alive()
        ctx.term()
        paths.close()
