"""Data parallelism: N engine cores, each with its own scheduler and KV cache, behind one frontend.

DataParallelClient has the face of one AsyncMPClient (add_request, abort_requests, get_output, call_utility,
dead, close), so AsyncEngineClient and the HTTP layer above it serve N engines as they serve one. Requests go
where dp_router.PrefixRouter says; the engines' outputs are merged into one stream, each batch tagged with its
engine's index (EngineCoreOutputs.engine_index) for the metrics' `engine` label.

An engine that dies does not take the others with it: its requests in flight end at once with an error
(EngineDeadError for their callers), the router stops sending it work, and, given `restart`, it is started again
(weights reloaded, the LoRA adapters added again, after a back-off) in a thread and rejoins; a crash loop
(MAX_RESTARTS within RESTART_WINDOW_S) leaves it down. The client is dead only when no engine serves or restarts. With one engine this is
`--restart-engine-on-failure`.

Given `start` (--enable-elastic-ep), the engines are elastic: `add_engine` starts one more, `retire_engines`
stops the highest-ranked ones once they have drained (frontend/dp/elastic.py decides when).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from pagedserve.common.errors import ENGINE_DIED
from pagedserve.common.lora import LORA_LOAD_TIMEOUT_S
from pagedserve.frontend.client.core_client import AsyncMPClient, CoreHandle, EngineDeadError
from pagedserve.frontend.dp.router import PrefixRouter
from pagedserve.ipc.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3
RESTART_WINDOW_S = 300.0


def _concat(results: list[Any]) -> list[Any]:
    return [item for result in results for item in result]


# Utility calls whose answer is every engine's, not the first one's (vLLM answers with the first engine's for
# all): collective_rpc gives each engine's ranks' results, engine after engine, so an RL driver sees every
# worker it reached; the engine is asleep (or its prefix cache reset) only when every engine is.
_MERGED_ANSWERS: dict[str, Callable[[list[Any]], Any]] = {
    "collective_rpc": _concat, "reload_weights": _concat, "is_sleeping": all, "reset_prefix_cache": all}


class DataParallelClient:
    def __init__(self, clients: list[AsyncMPClient], router: PrefixRouter,
                 restart: dict[int, Callable[[], CoreHandle]] | None = None,
                 start: Callable[[], CoreHandle] | None = None) -> None:
        """restart: engine index -> what starts a fresh core for it and waits until it is ready (blocking: it
        runs in a thread); engines on other nodes have none. start: what starts a new engine's core (elastic
        scaling), None when the engines are fixed."""
        self.clients = clients
        self.router = router
        self._restart = restart or {}
        self.start = start
        self.draining: set[int] = set()               # engines being scaled away: no new requests, no restart
        self._drain_progress = asyncio.Event()         # set whenever a request leaves an engine
        self._closed = False
        self._down: dict[int, str] = {}               # engine -> why it is out of service
        self._restarting: set[int] = set()
        self._restarts: dict[int, list[float]] = {}
        self._engine_of: dict[str, int] = {}
        self._merged: asyncio.Queue[EngineCoreOutputs | BaseException] | None = None
        self._tasks: list[asyncio.Task] = []
        self._pumps: dict[int, asyncio.Task] = {}     # engine -> the task moving its outputs to the merged queue
        # The adapters every engine holds (lora_int_id -> add_lora's arguments), replayed into a restarted core:
        # the frontend still routes requests to them by name.
        self._loras: dict[int, tuple[Any, ...]] = {}

    def use_mm_cache(self, gib: float) -> None:
        """Each engine's core keeps its own copy of the items sent to it (frontend/client/core_client.py)."""
        for client in self.clients:
            client.use_mm_cache(gib)

    @property
    def num_engines(self) -> int:
        return len(self.clients)

    @property
    def down(self) -> set[int]:
        """The engines out of service (dead, or restarting)."""
        return set(self._down)

    @property
    def dead(self) -> str | None:
        if len(self._down) < len(self.clients) or self._restarting:
            return None
        return "every data-parallel engine died: " + "; ".join(f"{i}: {why}" for i, why in sorted(self._down.items()))

    def engine_states(self) -> list[dict[str, Any]]:
        def state(i: int) -> str:
            if i in self._restarting:
                return f"restarting: {self._down[i]}"
            if i in self._down:
                return f"dead: {self._down[i]}"
            return "draining" if i in self.draining else "ok"
        return [{"engine": i, "state": state(i)} for i in range(len(self.clients))]

    async def add_request(self, request: EngineCoreRequest) -> None:
        if (why := self.dead) is not None:
            raise EngineDeadError(why)
        engine = self.router.route(request.prompt_token_ids)
        if engine is None:
            raise EngineDeadError("no data-parallel engine serves right now: " + "; ".join(
                f"{e['engine']}: {e['state']}" for e in self.engine_states()))
        self._engine_of[request.request_id] = engine
        try:
            await self.clients[engine].add_request(request)
        except BaseException:
            self._forget(request.request_id)
            raise

    async def abort_requests(self, request_ids: list[str]) -> None:
        by_engine: dict[int, list[str]] = {}
        for rid in request_ids:
            if (engine := self._engine_of.get(rid)) is not None and engine not in self._down:
                by_engine.setdefault(engine, []).append(rid)
        for engine, rids in by_engine.items():
            await self.clients[engine].abort_requests(rids)

    async def call_utility(self, method: str, *args: Any, timeout_s: float = 10.0) -> Any:
        """Every engine in service runs it (a ping, a prefix-cache reset, sleep); the first one's answer is
        returned, or for the calls of _MERGED_ANSWERS all of theirs merged, in engine order."""
        if (why := self.dead) is not None:
            raise EngineDeadError(why)
        up = [c for i, c in enumerate(self.clients) if i not in self._down]
        if not up:
            raise EngineDeadError("no engine serves right now: " + "; ".join(
                f"{e['engine']}: {e['state']}" for e in self.engine_states()))
        results = await asyncio.gather(*(c.call_utility(method, *args, timeout_s=timeout_s) for c in up))
        if method == "add_lora":            # kept in the order added, as the core keeps them (a replay keeps it)
            self._loras.pop(args[1], None)
            self._loras[args[1]] = args
        elif method == "remove_lora":
            self._forget_lora(args[0])
        merge = _MERGED_ANSWERS.get(method)
        return results[0] if merge is None else merge(results)

    async def get_output(self) -> EngineCoreOutputs:
        if self._merged is None:
            self._merged = asyncio.Queue()
            for i in range(len(self.clients)):
                self._start_pump(i)
        item = await self._merged.get()
        if isinstance(item, BaseException):
            self._merged.put_nowait(item)      # every later caller sees it too
            raise item
        for out in item.outputs:
            if out.finish_reason is not None:
                self._forget(out.request_id)
        return item

    def _start_pump(self, index: int) -> None:
        if self._merged is not None:        # else get_output starts every engine's pump when first called
            self._pumps[index] = asyncio.get_running_loop().create_task(self._pump(index))

    async def _pump(self, index: int) -> None:
        assert self._merged is not None
        client = self.clients[index]
        try:
            while True:
                outputs = await client.get_output()
                if outputs.engine_dead is not None:       # its last words: end as a death of this engine
                    raise EngineDeadError(outputs.engine_dead)
                outputs.engine_index = index
                self._merged.put_nowait(outputs)
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self._engine_died(index, str(exc))

    def _engine_died(self, index: int, why: str) -> None:
        assert self._merged is not None
        logger.error("data-parallel engine %d died: %s", index, why)
        self._down[index] = why
        self.router.set_available(index, False)
        lost = [rid for rid, engine in self._engine_of.items() if engine == index]
        for rid in lost:
            self._forget(rid)
        error = f"data-parallel engine {index} died: {why}"
        self._merged.put_nowait(EngineCoreOutputs(engine_index=index, outputs=[
            EngineCoreOutput(request_id=rid, new_token_ids=[], finish_reason="error", error=error,
                             error_kind=ENGINE_DIED) for rid in lost]))
        self.clients[index].close()
        if index not in self.draining and self._may_restart(index):
            self._restarting.add(index)
            self._tasks.append(asyncio.get_running_loop().create_task(self._restart_engine(index)))
        elif self.dead is not None:
            self._merged.put_nowait(EngineDeadError(self.dead))

    def _may_restart(self, index: int) -> bool:
        if index not in self._restart:
            return False
        now = time.monotonic()
        recent = [t for t in self._restarts.get(index, []) if now - t < RESTART_WINDOW_S]
        self._restarts[index] = recent + [now]
        if len(recent) >= MAX_RESTARTS:
            logger.error("data-parallel engine %d died %d times in %.0f s: left down", index, len(recent) + 1,
                         RESTART_WINDOW_S)
            return False
        return True

    async def _restart_engine(self, index: int) -> None:
        assert self._merged is not None
        old = self.clients[index]      # still this engine's when the new core is up, unless scaling removed it
        # Back-off: 0.5 s before the first restart, doubling with each recent one.
        await asyncio.sleep(0.5 * 2 ** (len(self._restarts.get(index, [])) - 1))
        try:
            proc = await asyncio.to_thread(self._restart[index])
            client = AsyncMPClient(proc.addresses, proc.token, proc, heartbeat_timeout_s=old.heartbeat_timeout_s)
            client.use_mm_cache(old.mm_cache_gb)        # the new core holds nothing yet: a fresh mirror
            # Outputs for a peer the core's output socket has not seen yet would be lost: be seen first.
            await client.call_utility("ping", timeout_s=30.0)
            await self._replay_loras(client)
        except Exception as exc:
            # A start can fail for a passing cause (a port the dead core's children still hold): it counts as
            # another death, tried again after a longer back-off until the restart budget is spent.
            logger.error("data-parallel engine %d failed to restart: %s", index, exc)
            self._down[index] = f"restart failed: {exc}"
            if not self._closed and self._may_restart(index):
                self._tasks.append(asyncio.get_running_loop().create_task(self._restart_engine(index)))
                return
            self._restarting.discard(index)
            if self.dead is not None:
                self._merged.put_nowait(EngineDeadError(self.dead))
            return
        if self._closed or index in self.draining or index >= len(self.clients) or self.clients[index] is not old:
            client.close()       # closed, or scaled away (and maybe grown again as a new engine) meanwhile
            self._restarting.discard(index)
            return
        self.clients[index] = client
        self._down.pop(index, None)
        self._restarting.discard(index)
        self.router.set_available(index, True)
        logger.info("data-parallel engine %d restarted and serving", index)
        self._start_pump(index)

    async def _replay_loras(self, client: AsyncMPClient) -> None:
        # Until none is missing: an adapter added to the serving engines meanwhile reaches this one too.
        done: dict[int, tuple[Any, ...]] = {}
        while todo := [(i, a) for i, a in self._loras.items() if done.get(i) != a]:
            for int_id, args in todo:
                await client.call_utility("add_lora", *args, timeout_s=LORA_LOAD_TIMEOUT_S)
                done[int_id] = args

    def _forget_lora(self, name_or_id: Any) -> None:
        # As the core resolves it (LoRARegistry._find): an id, or the newest id added under a name.
        found = name_or_id if name_or_id in self._loras else next(
            (i for i, args in reversed(self._loras.items()) if args[0] == name_or_id), None)
        self._loras.pop(found, None)

    def _forget(self, request_id: str) -> None:
        engine = self._engine_of.pop(request_id, None)
        if engine is not None:
            self.router.finished(engine)
            self._drain_progress.set()

    # ---------------------------------------------------------------- elastic scaling (frontend/dp/elastic.py)

    def requests_on(self, engines: set[int]) -> int:
        return sum(1 for engine in self._engine_of.values() if engine in engines)

    async def wait_drain_progress(self) -> None:
        """Until a request leaves some engine (finished, failed or aborted)."""
        self._drain_progress.clear()
        await self._drain_progress.wait()

    async def add_engine(self) -> int:
        """Start one more engine core (its adapters loaded as the others'), serving once this returns; its
        index. RuntimeError/TimeoutError from the core's start."""
        assert self.start is not None
        proc = await asyncio.to_thread(self.start)
        client = AsyncMPClient(proc.addresses, proc.token, proc,
                               heartbeat_timeout_s=self.clients[0].heartbeat_timeout_s)
        client.use_mm_cache(self.clients[0].mm_cache_gb)      # its core holds no items yet: a fresh mirror
        try:
            await client.call_utility("ping", timeout_s=30.0)      # be seen by its output socket first
            await self._replay_loras(client)
        except BaseException:
            client.close()
            raise
        if self._closed:
            client.close()
            raise RuntimeError("the client was closed while the engine started")
        index = len(self.clients)
        self.clients.append(client)
        self._restart[index] = self.start
        self.router.add_engines(index + 1)
        self._start_pump(index)
        logger.info("data-parallel engine %d started: %d engines", index, len(self.clients))
        return index

    async def retire_engines(self, num_engines: int) -> None:
        """Stop every engine from index `num_engines` on (the caller drained them: none has a request)."""
        while len(self.clients) > num_engines:
            index = len(self.clients) - 1
            if (pump := self._pumps.pop(index, None)) is not None:
                pump.cancel()
            client = self.clients.pop()
            proc = None
            if index not in self._down:        # a dead one's client, and core, were closed when it died
                proc, client.proc = client.proc, None
                client.close()
            for state in (self._down, self._restart, self._restarts):
                state.pop(index, None)
            self._restarting.discard(index)
            self.draining.discard(index)
            self.router.remove_engines(index)
            if proc is not None:           # stopping a core blocks until it exits: not on the event loop
                await asyncio.to_thread(proc.shutdown)
            logger.info("data-parallel engine %d stopped: %d engines", index, len(self.clients))

    def close(self) -> None:
        self._closed = True
        for task in [*self._tasks, *self._pumps.values()]:
            task.cancel()
        for index, client in enumerate(self.clients):
            if index not in self._down:
                client.close()
