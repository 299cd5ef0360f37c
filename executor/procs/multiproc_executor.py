"""One worker per rank; the engine core broadcasts each step and rank 0 answers.

Here each worker is a child process on this machine (ipc:// sockets). The Ray executor (ray_executor.py)
reuses all of this with workers as Ray actors: it overrides where the sockets bind and how workers start,
are watched and are stopped (a WorkerGroup)."""
from __future__ import annotations

import logging
import multiprocessing.connection
import os
import threading
import time
from abc import ABC, abstractmethod
from typing import Any

import msgspec
import zmq

from pagedserve.common import envs
from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.common.config.wire import config_to_builtins
from pagedserve.common.process_utils import ModuleProcess, stop_at_exit
from pagedserve.common.throttled_log import ThrottledLog
from pagedserve.executor.procs.executor import Executor, OutputToCome
from pagedserve.executor.procs.heartbeat import HeartbeatWatch, heartbeat_interval
from pagedserve.executor.procs.worker_proc import WorkerLaunch
from pagedserve.ipc.bound_sockets import BoundSockets
from pagedserve.ipc.broadcast import BroadcastWriter
from pagedserve.ipc.messages import (ExecuteModel, ModelRunnerOutput, SchedulerOutput, WorkerCall, WorkerResponse,
                                     WorkerShutdown)
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import free_tcp_port

logger = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
_POLL_MS = 50
_MONITOR_TICK_S = 0.25      # the most the monitor sleeps: bounds detection slack and shutdown
_bad_response_log = ThrottledLog(logger)


class WorkerDiedError(RuntimeError):
    pass


class WorkerGroup(ABC):
    """The started workers, whatever runs them: how a rank's death is seen, and how they are ended."""

    @abstractmethod
    def wake_fds(self) -> list[int]:
        """File descriptors that turn readable when a rank exits (the monitor wakes on them at once)."""

    @abstractmethod
    def dead(self) -> str | None:
        """Why a rank is gone, or None while all run (non-blocking)."""

    @abstractmethod
    def wait_for_death(self, timeout_s: float) -> None:
        """Wait up to timeout_s for any rank to end (a rank's error may be its peer's death)."""

    @abstractmethod
    def stop(self, graceful: bool) -> None:
        """End every rank: given up to a few seconds after a shutdown broadcast when graceful, then killed."""


class ProcessGroup(WorkerGroup):
    """Workers as `python -m` children of this process (they die with it: see setup_child_process)."""

    def __init__(self, launches: list[WorkerLaunch]) -> None:
        self.procs: list[ModuleProcess] = []
        for launch in launches:
            self.procs.append(ModuleProcess("pagedserve.executor.procs.worker_proc", msgspec.json.encode(launch),
                                            name=f"pagedserve-worker-{launch.rank}"))

    def wake_fds(self) -> list[int]:
        return [p.sentinel for p in self.procs]

    def dead(self) -> str | None:
        for rank, proc in enumerate(self.procs):
            if not proc.is_alive():
                return f"worker rank {rank} died (exit code {proc.exitcode})"
        return None

    def wait_for_death(self, timeout_s: float) -> None:
        multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=timeout_s)

    def stop(self, graceful: bool) -> None:
        if graceful:
            deadline = time.monotonic() + 5
            for proc in self.procs:
                proc.join(max(0.0, deadline - time.monotonic()))
        for proc in self.procs:     # SIGKILL ends a SIGSTOPped process too
            if proc.is_alive():
                proc.kill()
        for proc in self.procs:
            proc.join(5)
            proc.close()


class MultiProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        self.world_size = config.parallel.world_size
        self.dead: str | None = None
        self.workers: WorkerGroup | None = None
        self._closing = False
        tcp_host = self._tcp_host()
        self.bound = BoundSockets("exec", tcp_host)
        self.responses = self.bound.bind("resp", zmq.PULL)
        self.heartbeats = self.bound.bind("hb", zmq.PULL)
        self.heartbeat_timeout_s = config.parallel.worker_heartbeat_timeout_s
        self.writer = BroadcastWriter(num_readers=self.world_size, max_message_bytes=MAX_MESSAGE_BYTES,
                                      tcp_host=tcp_host)
        self.encoder = MsgpackEncoder()
        self.decoder = MsgpackDecoder(WorkerResponse)
        # A script that never calls shutdown must still end promptly, leaving no worker behind.
        self._cancel_exit_hook = stop_at_exit(self, lambda executor: executor.shutdown())
        try:
            self._start_workers()
        except BaseException:
            self.shutdown()
            raise
        self._monitor_thread = threading.Thread(target=self._monitor, name="worker-monitor", daemon=True)
        self._monitor_thread.start()

    # ---------------------------------------------------------------- what a subclass places elsewhere

    def _tcp_host(self) -> str | None:
        """This node's address when workers may sit on other machines (sockets on TCP); None: ipc files."""
        return None

    def _spawn(self, launches: list[WorkerLaunch]) -> WorkerGroup:
        # `python -m` children, not multiprocessing: they never re-import the user's __main__.
        return ProcessGroup(launches)

    # ---------------------------------------------------------------- start

    def _start_workers(self) -> None:
        host = self._tcp_host() or "127.0.0.1"
        init_method = f"tcp://{f'[{host}]' if ':' in host else host}:{free_tcp_port(host)}"
        engine_config = config_to_builtins(self.config)      # resolved once, in this (the core's) process
        launches = [WorkerLaunch(
            engine_config=engine_config, rank=rank, init_method=init_method,
            broadcast_handle=msgspec.msgpack.encode(self.writer.handle()),
            response_addr=BoundSockets.address(self.responses), parent_pid=os.getpid(),
            log_level=logging.getLogger().getEffectiveLevel(),
            heartbeat_addr=BoundSockets.address(self.heartbeats),
            heartbeat_interval_s=heartbeat_interval(self.heartbeat_timeout_s), curve=self.bound.client_keys)
            for rank in range(self.world_size)]
        self.workers = self._spawn(launches)
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
        """Watch every rank for death (its WorkerGroup) and for silence (its heartbeat)."""
        watch = HeartbeatWatch(self.heartbeats, self.world_size, self.heartbeat_timeout_s)
        poller = zmq.Poller()
        poller.register(self.heartbeats, zmq.POLLIN)
        for fd in self.workers.wake_fds():
            poller.register(fd, zmq.POLLIN)
        while not self._closing and self.dead is None:
            wait_s = min(_MONITOR_TICK_S, max(0.0, watch.seconds_left()))
            poller.poll(int(wait_s * 1000) + 1)
            if self._closing:
                return
            why = self.workers.dead()
            if why is not None:
                self._mark_dead(why)
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
        if self.workers is not None and (why := self.workers.dead()) is not None:   # before the monitor wakes
            self.dead = why
            raise WorkerDiedError(why)

    def _raise_worker_error(self, resp: WorkerResponse) -> None:
        # A rank that lost its peer fails in its collective; the peer's death is the real cause.
        self.workers.wait_for_death(1.0)
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

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        self._broadcast(WorkerCall(method, list(args), dict(kwargs or {})))
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

    def _say_shutdown(self) -> bool:
        try:
            self.writer.broadcast(self.encoder.encode(WorkerShutdown()), timeout_s=2.0)
        except Exception:   # a stuck worker is killed anyway
            return False
        return True

    def shutdown(self) -> None:
        if self._closing:
            return
        self._closing = True
        self._cancel_exit_hook()
        if self.workers is not None:
            graceful = self.dead is None and self.workers.dead() is None and self._say_shutdown()
            self.workers.stop(graceful)
        if hasattr(self, "_monitor_thread"):
            self._monitor_thread.join(timeout=2)
        self.writer.close()
        self.responses.close(linger=0)
        self.heartbeats.close(linger=0)
        self.bound.close()
