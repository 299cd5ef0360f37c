"""Requests whose KV a connector is loading (vLLM's WAITING_FOR_REMOTE_KVS): out of the waiting queue and out
of the batch, holding their blocks, until the workers report the load done. The batch never waits for them."""
from __future__ import annotations

from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.core.kv_connector.base import KVConnectorScheduler
from pagedserve.core.kv_cache.block_pool import KVCacheBlock
from pagedserve.core.request import Request, RequestStatus
from pagedserve.ipc.messages import KVConnectorOutput


class WaitingForKV:
    def __init__(self, connector: KVConnectorScheduler, kv: KVCacheManager) -> None:
        self.connector = connector
        self.kv = kv
        self.requests: dict[str, Request] = {}
        self.num_done = 0               # requests the last report finished loading

    def start(self, request: Request, hit_blocks: list[KVCacheBlock], num_hit: int) -> bool:
        """Whether the request's next blocks load from the connector: then it holds blocks for them and waits."""
        num_external, load_async = self.connector.get_num_new_matched_tokens(request, num_hit)
        if num_external == 0:
            return False
        if not load_async:      # every connector here loads before the request's first step
            raise NotImplementedError("a KV connector that loads within the request's step")
        # Not in the prefix cache until they arrived: no other request may hit blocks still being filled.
        if self.kv.allocate_slots(request, num_external, hit_blocks, num_hit, cache=False) is None:
            self.connector.update_state_after_alloc(request, [], 0)
            return False
        self.connector.update_state_after_alloc(request, self.kv.get_block_ids(request.request_id), num_external)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        self.requests[request.request_id] = request
        return True

    def finish(self, output: KVConnectorOutput | None) -> list[Request]:
        """The requests whose loads are done, ready to be scheduled from the tokens that arrived."""
        ready = []
        finished = self.connector.update_connector_output(output) if output is not None else {}
        for rid, num_computed in finished.items():
            request = self.requests.pop(rid, None)
            if request is None:
                continue                 # aborted while it loaded: its blocks are already free
            request.num_computed_tokens = num_computed
            self.kv.cache_blocks(request, num_computed)
            request.status = RequestStatus.WAITING
            ready.append(request)
        self.num_done = len(ready)
        return ready

    def remove(self, request: Request) -> None:
        self.requests.pop(request.request_id, None)
