"""One worker, inside the engine core's own process."""
from __future__ import annotations

from typing import Any

from pagedserve.common.config import EngineConfig
from pagedserve.executor.procs.executor import Executor
from pagedserve.ipc.messages import ModelRunnerOutput, SchedulerOutput


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs tensor_parallel_size=1 only")
        from pagedserve.executor.worker.worker import Worker    # here, not at import: see backends.py
        self.worker = Worker(config, rank=0)
        self.worker.init_device()
        self.worker.load_model()

    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return [self.worker.call_remote(method, args)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)
