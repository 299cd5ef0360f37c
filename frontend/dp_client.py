"""Data parallelism: N engine cores, each with its own scheduler and KV cache, behind one frontend.

DataParallelClient has the face of one AsyncMPClient (add_request, abort_requests, get_output, call_utility,
dead, close), so AsyncEngineClient and the HTTP layer above it serve N engines as they serve one. Requests go
where dp_router.PrefixRouter says; the engines' outputs are merged into one stream, each batch tagged with its
engine's index (EngineCoreOutputs.engine_index) for the metrics' `engine` label. An engine that dies takes
the server with it, as one engine's death does (EngineDeadError naming it).
"""
from __future__ import annotations

import asyncio
from typing import Any

from pagedserve.frontend.core_client import AsyncMPClient, EngineDeadError
from pagedserve.frontend.dp_router import PrefixRouter
from pagedserve.ipc.messages import EngineCoreOutputs, EngineCoreRequest


class DataParallelClient:
    def __init__(self, clients: list[AsyncMPClient], router: PrefixRouter) -> None:
        self.clients = clients
        self.router = router
        self._engine_of: dict[str, int] = {}
        self._merged: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._pumps: list[asyncio.Task] = []

    @property
    def num_engines(self) -> int:
        return len(self.clients)

    @property
    def dead(self) -> str | None:
        for index, client in enumerate(self.clients):
            if client.dead is not None:
                return f"data-parallel engine {index}: {client.dead}"
        return None

    def engine_states(self) -> list[dict[str, Any]]:
        return [{"engine": i, "state": "ok" if c.dead is None else f"dead: {c.dead}"}
                for i, c in enumerate(self.clients)]

    async def add_request(self, request: EngineCoreRequest) -> None:
        engine = self.router.route(request.prompt_token_ids)
        self._engine_of[request.request_id] = engine
        try:
            await self.clients[engine].add_request(request)
        except BaseException:
            self._forget(request.request_id)
            raise

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            if (engine := self._engine_of.get(rid)) is not None:
                by_engine.setdefault(engine, []).append(rid)
        for engine, rids in by_engine.items():
            await self.clients[engine].abort_requests(rids)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        """Every engine runs it (a ping, a prefix-cache reset); engine 0's answer is returned."""
        results = await asyncio.gather(*(c.call_utility(method, *args, timeout_s=timeout_s) for c in self.clients))
        return results[0]

    async def get_output(self) -> EngineCoreOutputs:
        if self._merged is None:
            self._merged = asyncio.Queue()
            self._pumps = [asyncio.get_running_loop().create_task(self._pump(i)) for i in range(len(self.clients))]
        item = await self._merged.get()
        if isinstance(item, BaseException):
            self._merged.put_nowait(item)      # every later caller sees it too
            raise item
        for out in item.outputs:
            if out.finish_reason is not None:
                self._forget(out.request_id)
        return item

    async def _pump(self, index: int) -> None:
        assert self._merged is not None
        try:
            while True:
                outputs = await self.clients[index].get_output()
                outputs.engine_index = index
                self._merged.put_nowait(outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._merged.put_nowait(exc if isinstance(exc, EngineDeadError)
                                    else EngineDeadError(f"data-parallel engine {index}: {exc}"))

    def _forget(self, request_id: str) -> None:
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self.router.finished(engine)

    def close(self) -> None:
        for task in self._pumps:
            task.cancel()
        for client in self.clients:
            client.close()
