"""Entry point of a worker process: build the Worker, then serve broadcast calls until shutdown."""
from __future__ import annotations

import logging
import signal
from typing import TYPE_CHECKING

import msgspec
import zmq

from pagedserve.common.config import EngineArgs
from pagedserve.common.process_utils import describe_exception, setup_child_process
from pagedserve.common.throttled_log import ThrottledLog
from pagedserve.executor.procs.heartbeat import start_heartbeat_sender
from pagedserve.ipc.broadcast import BroadcastReader
from pagedserve.ipc.messages import ExecuteModel, WorkerCall, WorkerInput, WorkerResponse, WorkerShutdown
from pagedserve.ipc.serial import MsgpackDecoder, MsgpackEncoder
from pagedserve.ipc.sockets import make_socket

if TYPE_CHECKING:     # for the annotation only: the real import is lazy, in run_worker
    from pagedserve.executor.worker.worker import Worker

logger = logging.getLogger(__name__)

_bad_frame_log = ThrottledLog(logger)


def run_worker(args_json: bytes, rank: int, init_method: str, broadcast_handle: bytes, response_addr: str,
               parent_pid: int, log_level: int = logging.INFO, heartbeat: tuple[str, float] | None = None) -> None:
    """heartbeat: (address, interval in s) of the executor's heartbeat socket."""
    logging.basicConfig(level=log_level, format=f"%(asctime)s %(levelname)s [worker {rank}] %(name)s: %(message)s")
    setup_child_process(f"ps-worker-{rank}", parent_pid, signal.SIGKILL)
    ctx = zmq.Context()
    if heartbeat is not None:
        start_heartbeat_sender(ctx, heartbeat[0], rank, heartbeat[1])
    sock = make_socket(ctx, response_addr, zmq.PUSH, bind=False)
    encoder = MsgpackEncoder()

    def reply(resp: WorkerResponse) -> None:
        sock.send_multipart(encoder.encode(resp), copy=False)

    try:
        from pagedserve.executor.worker.worker import Worker    # here, not at import: see backends.py
        config = EngineArgs(**msgspec.json.decode(args_json)).create_engine_config()
        worker = Worker(config, rank=rank, distributed_init_method=init_method)
        worker.init_device()
        worker.load_model()
        reader = BroadcastReader.connect(broadcast_handle, rank)
    except BaseException as exc:
        reply(WorkerResponse(rank=rank, kind="error", error=describe_exception(exc)))
        sock.close(linger=2000)
        raise SystemExit(1)
    reply(WorkerResponse(rank=rank, kind="ready"))
    code = _serve(worker, reader, reply, rank)
    reader.close()
    sock.close(linger=1000)
    raise SystemExit(code)


def _serve(worker: Worker, reader: BroadcastReader, reply, rank: int) -> int:
    decoder = MsgpackDecoder(WorkerInput)
    while True:
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
            return 0
        try:
            if isinstance(msg, ExecuteModel):
                output = worker.execute_model(msg.scheduler_output)
                if rank == 0:                # every rank computes the same tokens; one answer is enough
                    reply(WorkerResponse(rank=rank, kind="output", output=output))
            elif (why := worker.remote_refusal(msg.method)) is not None:
                # The caller's mistake, not this rank's failure: answer it and keep serving.
                reply(WorkerResponse(rank=rank, kind="refused", error=why))
            else:
                reply(WorkerResponse(rank=rank, kind="result", result=worker.call_remote(msg.method, msg.args)))
        except BaseException as exc:
            logger.exception("worker %d failed", rank)
            reply(WorkerResponse(rank=rank, kind="error", error=describe_exception(exc)))
            return 1
