"""The engine core inside the caller's process, behind the same calls as the process clients."""
from __future__ import annotations

from typing import Any

from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.core.engine_core import EngineCore
from pagedserve.executor.procs.backends import get_executor_class
from pagedserve.ipc.messages import (EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, EngineInfo,
                                     refused_output)


class InprocClient:
    def __init__(self, args: EngineArgs) -> None:
        # This client builds the core, so it picks and injects the executor (the core never imports one).
        self.core = EngineCore.from_engine_args(args, get_executor_class(args.executor_backend()))
        self.info: EngineInfo = self.core.info()
        self._rejected: list[EngineCoreOutput] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        """A request the input processor in this process built and checked: no socket to cross, so the core
        does not validate it again (it still refuses a used id or a full queue)."""
        try:
            self.core.add_request(request, checked=True)
        except ValueError as exc:
            self._rejected.append(refused_output(request.request_id, exc))

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs:
        if self._rejected:
            rejected, self._rejected = self._rejected, []
            return EngineCoreOutputs(outputs=rejected)
        return self.core.step()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any, timeout_s: float | None = None) -> Any:
        return self.core.call_utility(method, args)

    def close(self) -> None:
        self.core.shutdown()
