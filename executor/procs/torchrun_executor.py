"""Executor for a torchrun launch: every torchrun rank is a worker, rank 0 also runs the engine core.

Control messages (scheduler outputs, calls) go from rank 0 to every rank as msgpack bytes over a gloo
broadcast, so multi-node works through torchrun's own rendezvous and needs no extra sockets. The first
broadcast is the EngineConfig rank 0 resolved (JSON, common/config/wire.py): the other ranks never read a
model config or ask the Hub.

Liveness: torchrun's agent ends the job when a rank exits. A rank that is stopped or hung instead leaves
the others waiting in a collective; every collective here is bounded by `worker_heartbeat_timeout`
(the launcher gives the same bound to its process group), so that wait ends in an error, not a hang.
"""
from __future__ import annotations

import logging
import os
from datetime import timedelta
from typing import Any

import msgspec
import torch
import torch.distributed as dist

from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.common import envs
from pagedserve.common.config.wire import decode_engine_config, encode_engine_config
from pagedserve.executor.procs.executor import Executor
from pagedserve.executor.procs.worker_proc import answer_call
from pagedserve.executor.worker.worker import worker_class
from pagedserve.ipc.messages import (ExecuteModel, ModelRunnerOutput, SchedulerOutput, WorkerCall, WorkerInput,
                                     WorkerResponse, WorkerShutdown)

logger = logging.getLogger(__name__)


def _arrive_together(name: str) -> None:
    """Wait, up to the startup timeout, until every rank reaches this point. A collective waits only
    worker_heartbeat_timeout (and a new group's rendezvous the launch's store timeout, the same bound), while
    the ranks reach the control channel and finish loading the model at times that differ by more than that
    on a loaded machine: that gap alone failed the launch."""
    timeout = timedelta(seconds=envs.PAGEDSERVE_STARTUP_TIMEOUT)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                          timeout=timeout)
    prefix = f"pagedserve/{name}"
    store.set(f"{prefix}/{dist.get_rank()}", "1")
    store.wait([f"{prefix}/{r}" for r in range(dist.get_world_size())], timeout)


class ControlChannel:
    """Rank 0 -> all ranks message broadcast, and an all-gather of small results, on a gloo group."""

    def __init__(self, timeout_s: float) -> None:
        _arrive_together("control-channel")
        # gloo even when tensors use NCCL: control bytes live on the host.
        self.group = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
        self.encoder = msgspec.msgpack.Encoder()
        self.decoder = msgspec.msgpack.Decoder(WorkerInput)

    def broadcast(self, msg: Any | None) -> Any:
        """Rank 0 passes the message; other ranks pass None and get it back."""
        if dist.get_rank() == 0:
            self.broadcast_bytes(self.encoder.encode(msg))
            return msg
        return self.decoder.decode(self.broadcast_bytes(None))

    def broadcast_bytes(self, data: bytes | None) -> bytes:
        """Rank 0 passes the bytes (a byte tensor on the wire, never a pickled object); other ranks pass None."""
        size = torch.zeros(1, dtype=torch.int64)
        size[0] = len(data) if data is not None else 0
        dist.broadcast(size, 0, group=self.group)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8) if data
               else torch.empty(int(size), dtype=torch.uint8))
        dist.broadcast(buf, 0, group=self.group)
        return data if data is not None else buf.numpy().tobytes()

    def gather_results(self, result: Any, type_: Any = Any) -> list[Any]:
        """Every rank's result, in rank order, decoded as type_."""
        data = msgspec.msgpack.encode(result)
        world = dist.get_world_size()
        sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
        dist.all_gather(sizes, torch.tensor([len(data)]), group=self.group)
        width = int(max(s.item() for s in sizes))
        mine = torch.zeros(width, dtype=torch.uint8)
        mine[:len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        parts = [torch.empty(width, dtype=torch.uint8) for _ in range(world)]
        dist.all_gather(parts, mine, group=self.group)
        return [msgspec.msgpack.decode(p[:int(s.item())].numpy().tobytes(), type=type_) for p, s in zip(parts, sizes)]


class TorchrunExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if not dist.is_initialized() or dist.get_rank() != 0:
            raise RuntimeError("TorchrunExecutor runs on rank 0 of an initialized torchrun process group")
        if dist.get_world_size() != config.parallel.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size ({config.parallel.tensor_parallel_size}) must equal the "
                             f"torchrun world size ({dist.get_world_size()})")
        self.channel = ControlChannel(config.parallel.worker_heartbeat_timeout_s)
        self.channel.broadcast_bytes(encode_engine_config(config))      # serve_torchrun_worker's first receive
        self.worker = worker_class(config)(config, rank=0)
        self.worker.init_device()
        self.worker.load_model()
        _arrive_together("model-loaded")          # the first call below waits only the heartbeat timeout

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        call = self.channel.broadcast(WorkerCall(method, list(args), dict(kwargs or {})))
        # As the multiprocess executor's ranks answer: a refused call (collective_rpc's bad input) is every
        # rank's answer, gathered, then an error for the caller; the ranks keep serving.
        answers = self.channel.gather_results(answer_call(self.worker, call, 0), WorkerResponse)
        refused = [a for a in answers if a.kind == "refused"]
        if refused:
            raise ValueError(refused[0].error)
        return [a.result for a in answers]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        self.channel.broadcast(ExecuteModel(scheduler_output))
        return self.worker.execute_model(scheduler_output)

    def shutdown(self) -> None:
        if dist.is_initialized():
            self.channel.broadcast(WorkerShutdown())


def serve_torchrun_worker(timeout_s: float) -> None:
    """The loop of ranks > 0: take the EngineConfig rank 0 resolved, then follow rank 0's broadcasts until it
    says shut down. timeout_s: the bound on each collective (rank 0's worker_heartbeat_timeout)."""
    rank = dist.get_rank()
    channel = ControlChannel(timeout_s)
    config = decode_engine_config(channel.broadcast_bytes(None))
    worker = worker_class(config)(config, rank=rank)
    worker.init_device()
    worker.load_model()
    _arrive_together("model-loaded")
    while True:
        msg = channel.broadcast(None)
        if isinstance(msg, WorkerShutdown):
            return
        if isinstance(msg, ExecuteModel):
            worker.execute_model(msg.scheduler_output)
        elif isinstance(msg, WorkerCall):
            channel.gather_results(answer_call(worker, msg, rank))
