"""The engine core inside the caller's process, behind the same calls as the process clients."""
from __future__ import annotations

from typing import Any

from pagedserve.common.config import EngineConfig
from pagedserve.core.engine_core import EngineCore
from pagedserve.common.errors import error_kind
from pagedserve.executor.procs.backends import get_executor_class
from pagedserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest


class InprocClient:
    def __init__(self, config: EngineConfig) -> None:
        self.core = EngineCore(config, get_executor_class(config.parallel.distributed_executor_backend))
        self._rejected: list[EngineCoreOutput] = []

    def add_request(self, request: EngineCoreRequest) -> None:
        try:
            self.core.add_request(request)
        except ValueError as exc:
            self._rejected.append(EngineCoreOutput(request_id=request.request_id, new_token_ids=[],
                                                   finish_reason="error", error=str(exc),
                                                   error_kind=error_kind(exc)))

    def get_output(self, timeout_s: float | None = None) -> EngineCoreOutputs:
        if self._rejected:
            rejected, self._rejected = self._rejected, []
            return EngineCoreOutputs(outputs=rejected)
        return self.core.step()

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def call_utility(self, method: str, *args: Any) -> Any:
        if method == "reset_prefix_cache":
            return self.core.reset_prefix_cache()
        raise ValueError(f"unknown utility method {method!r}")

    def close(self) -> None:
        self.core.shutdown()
