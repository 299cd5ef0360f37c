"""The Executor interface the engine core drives, whatever runs the workers."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, Protocol

from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.ipc.messages import ModelRunnerOutput, SchedulerOutput


class PendingOutput(Protocol):
    """The output of a started step (a concurrent.futures.Future is one)."""

    def result(self, timeout: float | None = None) -> ModelRunnerOutput: ...


class OutputToCome:
    """A step the workers already started; its output is read when first asked for (a two-stage call)."""

    def __init__(self, receive: Callable[[], ModelRunnerOutput]) -> None:
        self._receive: Callable[[], ModelRunnerOutput] | None = receive
        self._output: ModelRunnerOutput | None = None

    @classmethod
    def ready(cls, output: ModelRunnerOutput) -> "OutputToCome":
        return cls(lambda: output)

    def result(self, timeout: float | None = None) -> ModelRunnerOutput:
        if self._receive is not None:
            self._output = self._receive()
            self._receive = None
        return self._output


class Executor(ABC):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        # An unsupported checkpoint is the user's error: one line naming what is supported, raised in the
        # engine core before any worker starts or weight is read (the registry imports no torch).
        from pagedserve.executor.model.models import resolve_architecture
        resolve_architecture(config.model.arch_config)

    @abstractmethod
    def collective_rpc(self, method: str, args: tuple[Any, ...] = (),
                       kwargs: dict[str, Any] | None = None) -> list[Any]:
        """Call Worker.<method>(*args, **kwargs) on every rank; one result per rank, in rank order."""

    @abstractmethod
    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        ...

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingOutput:
        """Start a step and return at once; its output comes from .result() (async scheduling).

        Steps run in the order they are started. This fallback runs the step before returning: correct,
        but it overlaps nothing; executors that can start a step without waiting override it."""
        return OutputToCome.ready(self.execute_model(scheduler_output))

    def determine_num_blocks(self) -> int:
        # Every rank must fit the same block count.
        return min(self.collective_rpc("determine_num_blocks"))

    def initialize_cache(self, num_blocks: int) -> None:
        self.collective_rpc("initialize_cache", (num_blocks,))

    def check_health(self) -> None:
        pass

    def shutdown(self) -> None:
        pass
