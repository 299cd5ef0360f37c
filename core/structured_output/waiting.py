"""Requests whose grammar is still compiling: held apart from the scheduler's waiting queue, so they never
block the requests behind them (a FCFS queue's head would otherwise stall everyone)."""
from __future__ import annotations

from typing import TYPE_CHECKING

from pagedserve.common.errors import RequestError
from pagedserve.core.request import Request, RequestStatus

if TYPE_CHECKING:
    from pagedserve.core.structured_output import StructuredOutputManager

# How long an otherwise idle busy loop sleeps on pending compiles before it looks at its inputs again.
IDLE_WAIT_S = 0.01


class GrammarWaiters:
    def __init__(self, manager: "StructuredOutputManager") -> None:
        self.manager = manager
        self._requests: dict[str, Request] = {}

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING_FOR_GRAMMAR
        self._requests[request.request_id] = request

    def remove(self, request: Request) -> None:
        self._requests.pop(request.request_id, None)

    def __len__(self) -> int:
        return len(self._requests)

    def take_ready(self) -> tuple[list[Request], list[tuple[Request, RequestError]]]:
        """(requests whose grammar is ready, (request, error) for those whose compile failed or timed out);
        both leave this set."""
        ready: list[Request] = []
        failed: list[tuple[Request, RequestError]] = []
        for rid, request in list(self._requests.items()):
            ok, error = self.manager.poll(request.structured, request.prompt_token_ids)
            if ok:
                ready.append(request)
            elif error is not None:
                failed.append((request, error))
            else:
                continue
            del self._requests[rid]
        return ready, failed

    def wait(self) -> None:
        """Block briefly until a compile ends: for a step that had nothing else to run."""
        if self._requests:
            self.manager.wait_any([r.structured for r in self._requests.values()], IDLE_WAIT_S)
