"""The Executor interface the engine core drives, whatever runs the workers."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from pagedserve.common.config import EngineConfig
from pagedserve.ipc.messages import ModelRunnerOutput, SchedulerOutput


class OutputToCome:
    """A step the workers already started; its output is read when first asked for (a two-stage call)."""

    def __init__(self, receive: Callable[[], ModelRunnerOutput]) -> None:
        self._receive: Callable[[], ModelRunnerOutput] | None = receive
        self._output: ModelRunnerOutput | None = None

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if self._receive is not None:
            receive, self._receive = self._receive, None
            self._output = receive()
        return self._output


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # An unsupported checkpoint is the user's error: one line naming what is supported, raised in the
        # engine core before any worker starts or weight is read (the registry imports no torch).
        from pagedserve.executor.model.models import resolve_architecture
        resolve_architecture(config.model.hf_config)

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> list[Any]:
        """Call Worker.<method>(*args) on every rank; one result per rank."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> Future[ModelRunnerOutput]:
        """Start a step and return at once; the future holds its output (async scheduling).

        Steps run in the order they are started. This fallback runs the step before returning, which is
        correct but overlaps nothing; executors that can launch without waiting override it."""
        future: Future[ModelRunnerOutput] = Future()
        try:
            future.set_result(self.execute_model(scheduler_output))
        except Exception as exc:
            future.set_exception(exc)
        return future

    def determine_num_blocks(self) -> int:
        # Every rank must fit the same block count.
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
