"""The engine core's LoRA adapters: each checked once (common/lora.py), loaded on every rank, and unloaded least
recently used beyond max_cpu_loras, never while a request holds it.

A request names its adapter by id; the registry gives its digest (the prefix cache's salt) and holds it until
the request ends. Removing an adapter refuses new requests at once and unloads it once its last request ends.
An adapter unloaded for room is loaded again from its path when a request asks for it.
"""
from __future__ import annotations

import logging
from collections import Counter, OrderedDict
from collections.abc import Callable
from typing import Any

from pagedserve.common.config.engine_config import LoRAConfig
from pagedserve.common.errors import RequestError
from pagedserve.common.model.hub import local_or_hub_path
from pagedserve.common.lora import ADAPTER_FILES, AdapterInfo, inspect_adapter

logger = logging.getLogger(__name__)


class LoRARegistry:
    def __init__(self, config: LoRAConfig, hf_config: Any, collective_rpc: Callable[..., list[Any]],
                 download_dir: str | None = None) -> None:
        self.config = config
        self.hf_config = hf_config
        self.rpc = collective_rpc
        self.download_dir = download_dir
        self.infos: dict[int, AdapterInfo] = {}           # registered: requests may name them
        self.loaded: OrderedDict[int, AdapterInfo] = OrderedDict()   # on the ranks, least recently used first
        self.refs: Counter[int] = Counter()

    def add(self, name: str, int_id: int, path: str) -> dict[str, Any]:
        """Check and load an adapter (a reload when the id is known with other files); ValueError naming why
        it cannot be served.

        The id is the adapter's identity, as in vLLM; the name is a label that several ids may carry (an RL loop
        loads each new version of an adapter under its name with a new id). Each id keeps its own weights, and
        its digest keeps its KV apart in the prefix cache."""
        if isinstance(int_id, bool) or not isinstance(int_id, int) or int_id < 1:
            raise ValueError(f"lora_int_id must be an integer >= 1, got {int_id!r}")
        folder = local_or_hub_path(path, None, self.download_dir, ADAPTER_FILES, what=f"LoRA adapter {name!r}")[0]
        info = inspect_adapter(name, int_id, folder, self.hf_config, self.config.max_lora_rank)
        known = self.infos.get(int_id)
        if known is None or known.digest != info.digest or int_id not in self.loaded:
            if self.refs[int_id]:
                raise ValueError(f"LoRA adapter id {int_id} is in use by running requests; it cannot be replaced now")
            self._load(info)
        self._register(info)
        return self._describe(info)

    def remove(self, name_or_id: str | int) -> bool:
        """Unregister an adapter (by id, or by name: the newest id under it): new requests are refused; it
        unloads once unused."""
        int_id = self._find(name_or_id)
        if int_id is None:
            return False
        del self.infos[int_id]
        if not self.refs[int_id]:
            self._unload(int_id)
        return True

    def list(self) -> list[dict[str, Any]]:
        return [self._describe(info) for info in self.infos.values()]

    def acquire(self, int_id: int) -> bytes:
        """For a new request: the adapter's digest, the adapter loaded and held; RequestError if unknown."""
        info = self.infos.get(int_id)
        if info is None:
            raise RequestError.at("lora_request", f"lora_int_id {int_id} names no loaded LoRA adapter")
        if int_id not in self.loaded:
            self._load(info)
        self.loaded.move_to_end(int_id)
        self.refs[int_id] += 1
        return bytes.fromhex(info.digest)

    def release(self, int_id: int) -> None:
        self.refs[int_id] -= 1
        if self.refs[int_id] <= 0:
            del self.refs[int_id]
            if int_id not in self.infos:        # removed while requests still used it
                self._unload(int_id)

    def running_adapters(self, running_ids: set[int]) -> dict[str, list[str]]:
        """vllm:lora_requests_info's labels: the names of adapters with running and with waiting requests."""
        # A set: ids sharing a name (an adapter's versions) are one label, as vLLM counts adapters by name.
        running = sorted({self.infos[i].name for i in running_ids if i in self.infos})
        waiting = sorted({info.name for i, info in self.infos.items() if self.refs[i] and i not in running_ids})
        return {"running": running, "waiting": waiting}

    def _register(self, info: AdapterInfo) -> None:
        # Re-inserted so that `infos` stays in the order adapters were last added: a name shared by several
        # ids then means the newest of them (_find).
        self.infos.pop(info.int_id, None)
        self.infos[info.int_id] = info

    def _find(self, name_or_id: str | int) -> int | None:
        """An id as given, or the newest id added under a name (None: neither is registered)."""
        if isinstance(name_or_id, int) and name_or_id in self.infos:
            return name_or_id
        return next((i for i, info in reversed(self.infos.items()) if info.name == name_or_id), None)

    def _load(self, info: AdapterInfo) -> None:
        while len(self.loaded) >= self.config.max_cpu_loras:
            victim = next((i for i in self.loaded if not self.refs[i] and i != info.int_id), None)
            if victim is None:       # every loaded adapter has requests: go over the cap rather than fail them
                logger.warning("max_cpu_loras=%d: every loaded adapter is in use; loading %r beyond it",
                               self.config.max_cpu_loras, info.name)
                break
            self._unload(victim)
        held = self.rpc("add_lora", (info.int_id, info.path, info.scaling))
        self.loaded[info.int_id] = info
        logger.info("LoRA adapter %r (id %d, rank %d, %s): %.1f MiB on each rank, %d loaded", info.name,
                    info.int_id, info.rank, "+".join(info.targets), max(held) / (1 << 20), len(self.loaded))

    def _unload(self, int_id: int) -> None:
        if self.loaded.pop(int_id, None) is not None:
            self.rpc("remove_lora", (int_id,))

    @staticmethod
    def _describe(info: AdapterInfo) -> dict[str, Any]:
        return {"name": info.name, "int_id": info.int_id, "path": info.path, "rank": info.rank,
                "targets": list(info.targets), "digest": info.digest}
