"""One worker process per rank; the engine core broadcasts each step and rank 0 answers."""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
import time
from typing import Any

import msgspec
import zmq

from pagedserve.common import envs
from pagedserve.common.config import EngineConfig
from pagedserve.common.config_wire import config_to_builtins
from pagedserve.common.process_utils import ModuleProcess, stop_at_exit
from pagedserve.common.throttled_log import ThrottledLog
from pagedserve.executor.procs.executor import Executor, OutputToCome
from pagedserve.executor.procs.heartbeat import HeartbeatWatch, heartbeat_interval
from pagedserve.executor.procs.worker_proc import WorkerLaunch
from pagedserve.ipc.broadcast import BroadcastWriter
from pagedserve.ipc.messages import (ExecuteModel, ModelRunnerOutput, SchedulerOutput, WorkerCall, WorkerResponse,
                                     WorkerShutdown)
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import IpcPaths, free_tcp_port, make_socket

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
_POLL_MS = 50
_MONITOR_TICK_S = 0.25      # the most the monitor sleeps: bounds detection slack and shutdown
_bad_response_log = ThrottledLog(logger)


class WorkerDiedError(RuntimeError):
    pass


class MultiProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel.world_size
        self.paths = IpcPaths("exec")
        self.ctx = zmq.Context()
        self.responses = make_socket(self.ctx, self.paths.new("resp"), zmq.PULL, bind=True)
        self.heartbeats = make_socket(self.ctx, self.paths.new("hb"), zmq.PULL, bind=True)
        self.heartbeat_timeout_s = config.parallel.worker_heartbeat_timeout_s
        self.writer = BroadcastWriter(num_readers=self.world_size, max_message_bytes=MAX_MESSAGE_BYTES)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(WorkerResponse)
        self.dead: str | None = None
        self.procs: list[ModuleProcess] = []
        self._closing = False
        # A script that never calls shutdown must still end promptly, leaving no worker behind.
        self._cancel_exit_hook = stop_at_exit(self, lambda executor: executor.shutdown())
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._monitor_thread = threading.Thread(target=self._monitor, name="worker-monitor", daemon=True)
        self._monitor_thread.start()

    def _start_workers(self) -> None:
        # `python -m` children, not multiprocessing: they never re-import the user's __main__.
        init_method = f"tcp://127.0.0.1:{free_tcp_port()}"
        engine_config = config_to_builtins(self.config)      # resolved once, in this (the core's) process
        for rank in range(self.world_size):
            launch = WorkerLaunch(
                engine_config=engine_config, rank=rank, init_method=init_method,
                broadcast_handle=msgspec.msgpack.encode(self.writer.handle()),
                response_addr=self.responses.getsockopt_string(zmq.LAST_ENDPOINT), parent_pid=os.getpid(),
                log_level=logging.getLogger().getEffectiveLevel(),
                heartbeat_addr=self.heartbeats.getsockopt_string(zmq.LAST_ENDPOINT),
                heartbeat_interval_s=heartbeat_interval(self.heartbeat_timeout_s))
            self.procs.append(ModuleProcess("pagedserve.executor.procs.worker_proc", msgspec.json.encode(launch),
                                            name=f"pagedserve-worker-{rank}"))
        ready: set[int] = set()
        deadline = time.monotonic() + envs.PAGEDSERVE_STARTUP_TIMEOUT
        while len(ready) < self.world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"workers {sorted(set(range(self.world_size)) - ready)} did not start in time")
            resp = self._recv_response()
            if resp is None:
                continue
            if resp.kind == "error":
                raise RuntimeError(f"worker rank {resp.rank} failed to start: {resp.error}")
            ready.add(resp.rank)

    # ---------------------------------------------------------------- health

    def _monitor(self) -> None:
        """Watch every rank for death (its process sentinel) and for silence (its heartbeat)."""
        sentinels = {p.sentinel: rank for rank, p in enumerate(self.procs)}
        watch = HeartbeatWatch(self.heartbeats, self.world_size, self.heartbeat_timeout_s)
        poller = zmq.Poller()
        poller.register(self.heartbeats, zmq.POLLIN)
        for fd in sentinels:
            poller.register(fd, zmq.POLLIN)
        while not self._closing and self.dead is None:
            wait_s = min(_MONITOR_TICK_S, max(0.0, watch.seconds_left()))
            events = dict(poller.poll(int(wait_s * 1000) + 1))
            if self._closing:
                return
            died = [rank for fd, rank in sentinels.items() if fd in events]
            if died:
                proc = self.procs[died[0]]
                proc.join(1.0)      # its sentinel fires as it exits: reap it, for the exit code
                self._mark_dead(f"worker rank {died[0]} died (exit code {proc.exitcode})")
                return
            watch.drain()
            silent = watch.silent_rank()
            if silent is not None:
                rank, seconds = silent
                self._mark_dead(f"worker rank {rank} stopped responding: no heartbeat for {seconds:.1f} s "
                                f"(hung or stopped; worker_heartbeat_timeout={self.heartbeat_timeout_s:g} s)")

    def _mark_dead(self, reason: str) -> None:
        self.dead = reason
        logger.error(reason)

    def check_health(self) -> None:
        if self.dead is not None:
            raise WorkerDiedError(self.dead)
        for rank, proc in enumerate(self.procs):   # the monitor thread may not have woken yet
            if not proc.is_alive():
                self.dead = f"worker rank {rank} died (exit code {proc.exitcode})"
                raise WorkerDiedError(self.dead)

    def _raise_worker_error(self, resp: WorkerResponse) -> None:
        # A rank that lost its peer fails in its collective; the peer's death is the real cause.
        multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=1.0)
        self.check_health()
        raise RuntimeError(f"worker rank {resp.rank} failed: {resp.error}")

    def _recv_response(self) -> WorkerResponse | None:
        if self.responses.poll(_POLL_MS):
            frames = self.responses.recv_multipart(copy=False)
            try:
                return self.decoder.decode(frames)
            except Exception as exc:   # the socket file is private, but a bad frame must not kill the engine
                _bad_response_log.log("decode", "dropped an undecodable worker response: %s", type(exc).__name__)
                return None
        self.check_health()
        return None

    # ---------------------------------------------------------------- calls

    def _broadcast(self, msg: Any) -> None:
        self.check_health()
        self.writer.broadcast(self.encoder.encode(msg), timeout_s=60.0)

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        self._broadcast(WorkerCall(method, list(args)))
        answers: dict[int, WorkerResponse] = {}
        while len(answers) < self.world_size:
            resp = self._recv_response()
            if resp is None:
                continue
            if resp.kind == "error":
                self._raise_worker_error(resp)
            answers[resp.rank] = resp
        # Every rank answered (none is left to answer a later call with this one's reply), then refuse.
        refused = [a for a in answers.values() if a.kind == "refused"]
        if refused:
            raise ValueError(refused[0].error)
        return [answers[r].result for r in range(self.world_size)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self._broadcast(ExecuteModel(scheduler_output))
        return self._receive_output()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> OutputToCome:
        # The ranks start the step now; the core reads its output after scheduling the next one. Ranks
        # run steps in the order broadcast and rank 0 answers in that order.
        self._broadcast(ExecuteModel(scheduler_output))
        return OutputToCome(self._receive_output)

    def _receive_output(self) -> ModelRunnerOutput:
        while True:
            resp = self._recv_response()
            if resp is None:
                continue
            if resp.kind == "error":
                self._raise_worker_error(resp)
            if resp.kind == "output" and resp.output is not None:
                return resp.output

    def _stop_workers_gracefully(self) -> None:
        try:
            self.writer.broadcast(self.encoder.encode(WorkerShutdown()), timeout_s=2.0)
        except Exception:   # a stuck worker is killed by the caller anyway
            return
        deadline = time.monotonic() + 5
        for proc in self.procs:
            proc.join(max(0.0, deadline - time.monotonic()))

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._cancel_exit_hook()
        if self.dead is None and all(p.is_alive() for p in self.procs):
            self._stop_workers_gracefully()
        for proc in self.procs:     # SIGKILL ends a SIGSTOPped process too
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
        if hasattr(self, "_monitor_thread"):
            self._monitor_thread.join(timeout=2)
        self.writer.close()
        self.responses.close(linger=0)
        self.heartbeats.close(linger=0)
        self.ctx.term()
        for proc in self.procs:
            proc.close()
        self.paths.close()
