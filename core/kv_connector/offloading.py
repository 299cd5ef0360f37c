"""The OffloadingConnector's scheduler side: a tier of full blocks below the pool, keyed by their prefix
hashes (this slice: the disk tier, docs/kv_tiers.md)."""
from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from typing import Any

import msgspec

from pagedserve.common.kv_transfer.config import KVTransferConfig
from pagedserve.common.kv_transfer.layout import block_path
from pagedserve.core.kv_connector.base import KVConnectorScheduler
from pagedserve.core.kv_connector.disk_index import DiskIndex
from pagedserve.core.request import Request
from pagedserve.ipc.messages import (KVBlockTransfer, KVConnectorMetadata, KVConnectorOutput, KVTransferStats,
                                     SchedulerOutput)


def _can_load(request: Request) -> bool:
    # Prompt logprobs need every prompt position's logits, so such a request computes its whole prompt (as
    # with the prefix cache); KV under weights updated in this process is never shared across processes.
    return request.persistent_kv and request.sampling_params.prompt_logprobs is None


class OffloadingConnectorScheduler(KVConnectorScheduler):
    def __init__(self, config: KVTransferConfig, block_size: int, device: str = "cpu") -> None:
        self.config = config
        self.stats = KVTransferStats(device="GPU" if device == "cuda" else device.upper())
        self.block_size = block_size
        self.index = DiskIndex(config.namespace_dir, config.size_bytes)
        self.saving = config.can_save
        self.queries = self.hits = 0
        self._matched: dict[str, tuple[int, int]] = {}      # request -> (first block, blocks) its lookup found
        self._load_start: dict[str, int] = {}               # request -> first block of its loads in flight
        self._loads: dict[str, list[KVBlockTransfer]] = {}  # planned for the next metadata
        self._saved_upto: dict[str, int] = {}               # request -> blocks already stored or handed over
        self._pending: dict[bytes, tuple[Request, int]] = {}   # saves in flight: key -> (request, depth)
        self._swap_ins: set[str] = set()                    # loads in flight of preempted requests resuming

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int, bool]:
        if not self.config.can_load or not _can_load(request):
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        # Whole blocks only, and at least one token left to compute (the last one's logits are sampled).
        end = min((request.num_tokens - 1) // bs, len(request.block_hashes))
        n = 0
        while start + n < end and self._stored(request.block_hashes[start + n], start + n):
            n += 1
        self.queries += max(0, request.num_tokens - num_computed_tokens)
        self.hits += n * bs
        looked = n + (1 if start + n < end else 0)          # the chain up to its first miss
        self.stats.block_lookups += looked
        self.stats.block_hits += n
        self.stats.block_misses += looked - n
        if n == 0:
            return 0, False
        self._matched[request.request_id] = (start, n)
        if request.num_preemptions:      # a swap-in: its blocks went to the tier as it ran (docs: swap)
            self._swap_ins.add(request.request_id)
        self.index.touch_chain(request.block_hashes[:start + n])
        # Loaded before the request's first step (the workers load at the start of the next step), not in it:
        # a block that turns out bad is then simply computed.
        return n * bs, True

    def update_state_after_alloc(self, request: Request, block_ids: list[int], num_external_tokens: int) -> None:
        matched = self._matched.pop(request.request_id, None)
        if not num_external_tokens or matched is None:
            return
        start, n = matched
        hashes = request.block_hashes
        self._loads[request.request_id] = [KVBlockTransfer(block_ids[i], hashes[i], i) for i in range(start, start + n)]
        self._load_start[request.request_id] = start

    def build_connector_meta(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
                             block_ids: Callable[[str], list[int]]) -> KVConnectorMetadata | None:
        saves = self._plan_saves(scheduler_output, requests, block_ids) if self.saving else []
        if not self._loads and not saves:
            return None
        meta = KVConnectorMetadata(loads=self._loads, saves=saves)
        self._loads = {}
        return meta

    def _plan_saves(self, scheduler_output: SchedulerOutput, requests: Mapping[str, Request],
                    block_ids: Callable[[str], list[int]]) -> list[KVBlockTransfer]:
        """Blocks of the scheduled requests that hold only known tokens (they have a hash) and whose KV is
        complete by the end of this step, not stored yet."""
        saves = []
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests[rid]
            start = self._saved_upto.get(rid, 0)
            end = min(len(request.block_hashes), request.num_computed_tokens // self.block_size)
            if end <= start or not request.persistent_kv:
                continue
            ids = block_ids(rid)
            for i in range(start, end):
                key = request.block_hashes[i]
                if key not in self._pending and not self._stored(key, i):
                    saves.append(KVBlockTransfer(ids[i], key, i, request.block_hashes[i - 1] if i else b""))
                    self._pending[key] = (request, i)
            self._saved_upto[rid] = end
        return saves

    def _stored(self, key: bytes, depth: int) -> bool:
        """Whether the tier holds the block. On shared storage another instance (a prefill's producer) may
        have written it, or removed it, since this one last looked: the disk answers, and the index learns.
        A block handed to the writer and not written yet counts: the workers load it from the writer's copy."""
        if not self.config.shared:
            return key in self.index or key in self._pending
        try:
            size = os.stat(block_path(self.config.namespace_dir, key, depth)).st_size
        except OSError:
            self.index.discard(key)
            return False
        if key not in self.index:
            self.index.add(key, depth, size)
        return True

    def update_connector_output(self, output: KVConnectorOutput) -> dict[str, int]:
        chains: dict[int, Request] = {}
        st = self.stats
        st.store_bytes += sum(nbytes for _, nbytes in output.saved)
        st.store_time_s += output.store_time_s
        st.load_bytes += output.load_bytes
        st.load_time_s += output.load_time_s
        st.stores_skipped += len(output.failed_saves)
        st.invalid_blocks += len(output.invalid_keys)
        for key, nbytes in output.saved:
            request, depth = self._pending.pop(key, (None, 0))
            if request is not None:
                self.index.add(key, depth, nbytes, request.block_hashes[depth - 1] if depth else b"")
                chains[id(request)] = request
        for request in chains.values():       # the new leaves go before their chain's first blocks
            self.index.touch_chain(request.block_hashes)
        self.index.evict()
        for key in output.failed_saves:
            self._pending.pop(key, None)
        for key in output.invalid_keys:
            self.index.discard(key)
        if output.saves_disabled:
            self.saving = False
        for rid, n in output.finished_recving.items():
            if rid in self._swap_ins:
                self._swap_ins.discard(rid)
                st.swapped_in_tokens += n * self.block_size
        return {rid: (self._load_start.pop(rid, 0) + n) * self.block_size
                for rid, n in output.finished_recving.items()}

    def transfer_stats(self) -> KVTransferStats:
        self.stats.evictions = self.index.evicted
        return msgspec.structs.replace(self.stats)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        rid = request.request_id
        for table in (self._matched, self._load_start, self._loads, self._saved_upto):
            table.pop(rid, None)
        self._swap_ins.discard(rid)
        return False, None

    def request_preempted(self, request: Request) -> None:
        # Its full blocks are in the tier or on their way (saved as each one filled): it resumes by loading
        # them. Saving starts over from its first block on resume, in case the tier evicted one meanwhile.
        self._saved_upto.pop(request.request_id, None)


def make_scheduler_connector(config: KVTransferConfig | None, block_size: int,
                             device: str = "cpu") -> KVConnectorScheduler | None:
    if config is None:
        return None
    # Both connectors are the disk tier; shared storage differs in config.shared (lookups and saves).
    return OffloadingConnectorScheduler(config, block_size, device)
