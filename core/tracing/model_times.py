"""Per-request model times for --collect-detailed-traces (vLLM's gen_ai.latency.time_in_model_forward and
time_in_model_execute): each step's times added to every request of the step that asked for them
(EngineCoreRequest.trace_model_times), and sent with its finished output.

Free when no request asks: the core checks `bool(model_times)` once a step, and no rank times its forward."""
from __future__ import annotations

from typing import Optional

from pagedserve.ipc.messages import EngineCoreOutput, SchedulerOutput


class ModelTimes:
    def __init__(self) -> None:
        self._sums: dict[str, list[float]] = {}      # request id -> [forward seconds, execute seconds]

    def __bool__(self) -> bool:
        return bool(self._sums)

    def track(self, request_id: str) -> None:
        self._sums[request_id] = [0.0, 0.0]

    def wanted(self, sched: SchedulerOutput) -> bool:
        """Whether a request of this step asked (then the ranks time their forward)."""
        return any(rid in self._sums for rid in sched.num_scheduled_tokens)

    def add_step(self, sched: SchedulerOutput, execute_s: float, forward_s: Optional[float]) -> None:
        """One step's times, to each of its requests that asked."""
        for rid in sched.num_scheduled_tokens:
            sums = self._sums.get(rid)
            if sums is not None:
                sums[0] += forward_s or 0.0
                sums[1] += execute_s

    def attach(self, outputs: list[EngineCoreOutput]) -> None:
        """The sums onto the finished outputs (and the requests forgotten: finished, aborted or failed)."""
        for out in outputs:
            if out.finish_reason is not None:
                sums = self._sums.pop(out.request_id, None)
                if sums is not None:
                    out.model_forward_time, out.model_execute_time = sums
