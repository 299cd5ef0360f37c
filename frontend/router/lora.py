"""`--routing-logic lora`: a request for a LoRA adapter goes to a replica that has it loaded (its /v1/models
lists it, as the probes read), the least loaded of them; when none has, the router loads it on the least
loaded healthy replica first (`POST /v1/load_lora_adapter`, which engine-serve serves with
--allow-runtime-lora-updating or VLLM_ALLOW_RUNTIME_LORA_UPDATING, docs/lora.md), then sends the request there.

Where an adapter is loaded from: the router's own --lora-modules NAME=PATH, else the `root` of a replica's
card for it (engine-serve lists an adapter's path there), so an adapter one replica was started with can be
spread to others. One load per (replica, adapter) at a time: concurrent first requests wait on the same load.
"""
from __future__ import annotations

import asyncio
import logging

import httpx

from pagedserve.frontend.router.pool import Replica, ReplicaPool

logger = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 120.0      # an adapter is read from disk (or the Hub) and checked before the answer


def parse_lora_modules(specs: tuple[str, ...]) -> dict[str, str]:
    """NAME=PATH pairs; ValueError naming the flag for any other shape."""
    out: dict[str, str] = {}
    for spec in specs:
        name, sep, path = spec.partition("=")
        if not sep or not name or not path:
            raise ValueError(f"--lora-modules takes NAME=PATH, got {spec!r}")
        out[name] = path
    return out


class LoraPlacer:
    def __init__(self, pool: ReplicaPool, client: httpx.AsyncClient, modules: dict[str, str]) -> None:
        self.pool, self.client, self.modules = pool, client, modules
        self._loads: dict[tuple[int, str], asyncio.Task[bool]] = {}

    def path_of(self, name: str | None) -> tuple[str, str | None] | None:
        """(where the adapter loads from, its base model if known), None when it is no known adapter."""
        if name is None:
            return None
        for replica in self.pool.replicas:
            for card in replica.models:
                if card.get("id") == name and card.get("parent") and card.get("root"):
                    return card["root"], card["parent"]
        return (self.modules[name], None) if name in self.modules else None

    async def place(self, name: str | None, skip: set[int]) -> Replica | None:
        """A healthy replica that now has the adapter, after loading it on one that had not (the least loaded
        that serves its base, if known, first); None when it is no known adapter or no replica would load it."""
        source = self.path_of(name)
        if source is None or name is None:
            return None
        path, base = source
        cold = [r for r in self.pool.candidates(None) if r.index not in skip and (base is None or r.serves(base))]
        for replica in sorted(cold, key=lambda r: r.load):
            if replica.serves(name) or await self._load_once(replica, name, path, base):
                return replica
        return None

    async def _load_once(self, replica: Replica, name: str, path: str, base: str | None) -> bool:
        key = (replica.index, name)
        task = self._loads.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._load(replica, name, path, base))
            self._loads[key] = task
            task.add_done_callback(lambda _: self._loads.pop(key, None))
        return await asyncio.shield(task)

    async def _load(self, replica: Replica, name: str, path: str, base: str | None) -> bool:
        try:
            r = await self.client.post(f"{replica.url}/v1/load_lora_adapter", headers=replica.headers(),
                                       json={"lora_name": name, "lora_path": path}, timeout=LOAD_TIMEOUT_S)
        except httpx.HTTPError as exc:
            logger.warning("loading adapter %s on %s failed: %s: %s", name, replica.url, type(exc).__name__, exc)
            return False
        # 400 "already been loaded": another router (or a client) loaded it since the last probe.
        if r.status_code != 200 and "already been loaded" not in r.text:
            logger.warning("replica %s refused to load adapter %s: %d %s", replica.url, name, r.status_code,
                           r.text[:300])
            return False
        logger.info("adapter %s loaded on %s from %s", name, replica.url, path)
        if not replica.serves(name):    # routable now, before the next probe lists it
            replica.models.append({"id": name, "object": "model", "parent": base, "root": path})
        return True
