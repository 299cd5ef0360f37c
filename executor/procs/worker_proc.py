"""Entry point of a worker process: build the Worker, then serve broadcast calls until shutdown.

Run as `python -m pagedserve.executor.procs.worker_proc` with a WorkerLaunch (JSON) on stdin: the
process never imports its launcher's __main__, so a user's script needs no main guard."""
from __future__ import annotations

import logging
import queue
import signal
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import msgspec
import zmq

from pagedserve.common.config.wire import config_from_builtins
from pagedserve.common.process_utils import (describe_exception, exit_without_teardown, read_launch_payload,
                                             setup_child_process)
from pagedserve.common.throttled_log import ThrottledLog
from pagedserve.executor.procs.heartbeat import start_heartbeat_sender
from pagedserve.ipc.broadcast import BroadcastReader
from pagedserve.ipc.curve import CurveClientKeys
from pagedserve.ipc.messages import ExecuteModel, WorkerCall, WorkerInput, WorkerResponse, WorkerShutdown
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import make_socket

if TYPE_CHECKING:     # for the annotations only: the real import is lazy, in run_worker
    from pagedserve.executor.worker.step_output import PendingStep
    from pagedserve.executor.worker.worker import Worker

logger = logging.getLogger(__name__)

_bad_frame_log = ThrottledLog(logger)


class WorkerLaunch(msgspec.Struct, frozen=True):
    """Everything a worker process needs, written by the executor to its stdin (see ModuleProcess)."""
    # The resolved EngineConfig (common/config/wire.py): the worker reads no model config or Hub to rebuild it.
    engine_config: dict[str, Any]
    rank: int
    init_method: str                 # torch.distributed rendezvous
    broadcast_handle: bytes          # msgpack of the executor's BroadcastWriter handle
    response_addr: str               # PUSH to the executor
    parent_pid: int
    log_level: int = logging.INFO
    heartbeat_addr: str | None = None
    heartbeat_interval_s: float = 1.0
    curve: CurveClientKeys | None = None     # the executor's sockets are on TCP (workers on other nodes)


class WorkerStartFailed(SystemExit):
    """SystemExit(1) of a rank that could not start, carrying what its error reply to the executor says."""

    def __init__(self, error: str) -> None:
        super().__init__(1)
        self.error = error


def run_worker(launch: WorkerLaunch) -> None:
    """The worker process's whole life: it exits when the executor says so, or dies with its parent."""
    setup_child_process(f"ps-worker-{launch.rank}", launch.parent_pid, signal.SIGKILL)
    exit_without_teardown(serve_worker(launch))


def serve_worker(launch: WorkerLaunch) -> int:
    """Build the rank's Worker, say ready (or why not), serve until shutdown; the exit code. A Ray actor runs
    this in its own process, whose life Ray owns. WorkerStartFailed (a SystemExit(1)) when the rank cannot
    start: the interpreter's teardown then terminates the ZeroMQ context, which is what flushes the error reply
    to the executor."""
    rank = launch.rank
    logging.basicConfig(level=launch.log_level,
                        format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: %(message)s")
    secure = launch.curve.secure if launch.curve is not None else None
    ctx = zmq.Context()
    if launch.heartbeat_addr is not None:
        start_heartbeat_sender(ctx, launch.heartbeat_addr, rank, launch.heartbeat_interval_s, secure)
    sock = make_socket(ctx, launch.response_addr, zmq.PUSH, bind=False, secure=secure)
    encoder = MsgpackEncoder()

    def reply(resp: WorkerResponse) -> None:
        sock.send_multipart(encoder.encode(resp), copy=False)

    try:
        from pagedserve.executor.worker.worker import worker_class    # here, not at import: see backends.py
        config = config_from_builtins(launch.engine_config)
        worker = worker_class(config)(config, rank=rank, distributed_init_method=launch.init_method)
        worker.init_device()
        worker.load_model()
        reader = BroadcastReader.connect(launch.broadcast_handle, rank)
    except BaseException as exc:
        error = describe_exception(exc)
        reply(WorkerResponse(rank=rank, kind="error", error=error))
        sock.close(linger=2000)
        raise WorkerStartFailed(error)
    reply(WorkerResponse(rank=rank, kind="ready"))
    code = _serve(worker, reader, reply, rank)
    reader.close()
    sock.close(linger=1000)
    return code


class _Replies:
    """The rank's answers, sent in order from a thread of their own: a step's output is taken (waited for
    on the device) there, while the main loop launches the next step (async scheduling on the device)."""

    def __init__(self, reply: Callable[[WorkerResponse], None], rank: int, sends_outputs: bool) -> None:
        self._reply = reply
        self._rank = rank
        self._sends_outputs = sends_outputs
        self._queue: queue.SimpleQueue[PendingStep | WorkerResponse | None] = queue.SimpleQueue()
        self.failed = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"ps-worker-{rank}-replies", daemon=True)
        self._thread.start()

    def put(self, item: PendingStep | WorkerResponse) -> None:
        self._queue.put(item)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if isinstance(item, WorkerResponse):
                self._reply(item)
                continue
            try:
                output = item.result()
            except BaseException as exc:
                logger.exception("worker %d failed", self._rank)
                self._reply(WorkerResponse(rank=self._rank, kind="error", error=describe_exception(exc)))
                self.failed.set()
                return
            if self._sends_outputs:
                self._reply(WorkerResponse(rank=self._rank, kind="output", output=output))


def _serve(worker: Worker, reader: BroadcastReader, reply: Callable[[WorkerResponse], None], rank: int) -> int:
    # The last stage's first rank: the ranks of a stage compute the same tokens, one answer is enough, and
    # only the last stage samples.
    replies = _Replies(reply, rank, worker.pp.is_last and worker.tp.rank == 0)
    try:
        return _serve_loop(worker, reader, replies, rank)
    finally:
        replies.close()


def answer_call(worker: Worker, msg: WorkerCall, rank: int) -> WorkerResponse:
    """A named call's answer. A user's method (collective_rpc: RL_METHODS, the extension's) that raises
    ValueError or TypeError refused the caller's input and left the rank as it was (a weight update checks
    everything before it copies), so the rank keeps serving; the engine's own calls fail the rank as before.
    Also the torchrun executor's ranks' answer (torchrun_executor.py)."""
    if (why := worker.remote_refusal(msg.method)) is not None:
        # The caller's mistake, not this rank's failure: answer it and keep serving.
        return WorkerResponse(rank=rank, kind="refused", error=why)
    try:
        return WorkerResponse(rank=rank, kind="result", result=worker.call_remote(msg.method, msg.args, msg.kwargs))
    except (ValueError, TypeError) as exc:
        if msg.method not in worker.RL_METHODS | worker.EXTENSION_METHODS:
            raise
        return WorkerResponse(rank=rank, kind="refused", error=f"{msg.method} on rank {rank}: {exc}")


def _serve_loop(worker: Worker, reader: BroadcastReader, replies: _Replies, rank: int) -> int:
    decoder = MsgpackDecoder(WorkerInput)
    while not replies.failed.is_set():
        try:
            frames = reader.recv(timeout_s=1.0)
        except TimeoutError:
            continue
        try:
            msg = decoder.decode(frames)
        except Exception as exc:
            # Only the engine core writes to this socket; dropping a bad frame keeps the rank serving.
            _bad_frame_log.log("decode", "worker %d dropped an undecodable broadcast message: %s: %s", rank,
                               type(exc).__name__, str(exc)[:200])
            continue
        if isinstance(msg, WorkerShutdown):
            worker.shutdown()
            return 0
        try:
            if isinstance(msg, ExecuteModel):
                replies.put(worker.execute_model_async(msg.scheduler_output))
            else:
                replies.put(answer_call(worker, msg, rank))
        except BaseException as exc:
            logger.exception("worker %d failed", rank)
            replies.put(WorkerResponse(rank=rank, kind="error", error=describe_exception(exc)))
            return 1
    return 1


def main() -> None:
    run_worker(msgspec.json.decode(read_launch_payload(), type=WorkerLaunch))


if __name__ == "__main__":
    main()
