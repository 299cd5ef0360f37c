"""One worker, inside the engine core's own process."""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.executor.procs.executor import Executor
from pagedserve.ipc.messages import ModelRunnerOutput, SchedulerOutput

if TYPE_CHECKING:
    from pagedserve.executor.worker.step_output import PendingStep


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        super().__init__(config)
        if config.parallel.tensor_parallel_size != 1:
            raise ValueError("the in-process executor runs tensor_parallel_size=1 only")
        from pagedserve.executor.worker.worker import worker_class    # here, not at import: see backends.py
        self.worker = worker_class(config)(config, rank=0)
        self.worker.init_device()
        self.worker.load_model()
        self._step_thread: ThreadPoolExecutor | None = None

    def collective_rpc(self, method: str, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        if self._step_thread is not None:    # after the steps already launched there, never beside one
            return [self._step_thread.submit(self.worker.call_remote, method, args, kwargs).result()]
        return [self.worker.call_remote(method, args, kwargs)]

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute_model(scheduler_output)

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> "_Launched":
        # One thread: steps are launched in submission order, and the worker keeps each step's sampled ids
        # in its request states (on the device until taken), where the next step's inputs read them. torch
        # releases the GIL while it computes, so the core schedules the next step meanwhile.
        if self._step_thread is None:
            self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="uniproc-step",
                                                   initializer=self.worker.bind_thread)
        return _Launched(self._step_thread.submit(self.worker.execute_model_async, scheduler_output))

    def shutdown(self) -> None:
        if self._step_thread is not None:
            self._step_thread.shutdown(wait=True)
            self._step_thread = None
        self.worker.shutdown()


class _Launched:
    """A step handed to the step thread: launched there, its output taken here (the two may overlap the
    next step's launch)."""

    def __init__(self, launch: "Future[PendingStep]") -> None:
        self._launch = launch

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        return self._launch.result(timeout).result()
