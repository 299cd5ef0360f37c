"""The scheduler's running totals as the SchedulerStats each step's outputs carry."""
from __future__ import annotations

from collections.abc import Sized
from typing import TYPE_CHECKING, Protocol

from pagedserve.ipc.messages import SchedulerStats

if TYPE_CHECKING:
    from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
    from pagedserve.core.kv_connector.base import KVConnectorScheduler
    from pagedserve.core.kv_connector.waiting import WaitingForKV
    from pagedserve.core.request import Request
    from pagedserve.core.spec_decode.state import SpecDecodeState


class CountedState(Protocol):
    """What the totals are read from (the Scheduler; named here so that this module need not import it)."""
    kv: KVCacheManager
    loads: WaitingForKV | None
    running: list[Request]
    waiting: Sized
    num_preemptions: int
    spec: SpecDecodeState | None
    connector: KVConnectorScheduler | None


def scheduler_stats(sched: CountedState) -> SchedulerStats:
    prefix = sched.kv.prefix_stats
    loading = len(sched.loads.requests) if sched.loads is not None else 0
    out = SchedulerStats(
        num_running=len(sched.running), num_waiting=len(sched.waiting) + loading, kv_cache_usage=sched.kv.usage,
        prefix_cache_queries=prefix.queries, prefix_cache_hits=prefix.hits, num_preemptions=sched.num_preemptions)
    if sched.spec is not None:
        out.spec_num_drafts, out.spec_num_draft_tokens = sched.spec.num_drafts, sched.spec.num_draft_tokens
        out.spec_num_accepted_tokens = sched.spec.num_accepted_tokens
        out.spec_accepted_per_pos = list(sched.spec.accepted_per_pos)
    if sched.connector is not None:
        out.external_prefix_cache_queries = sched.connector.queries
        out.external_prefix_cache_hits = sched.connector.hits
        out.num_loading, out.num_loads_done = loading, sched.loads.num_done
        out.kv_connector_stats = sched.connector.transfer_stats()
    return out


def pick_victim(running: list[Request], in_flight: dict[str, int], policy: str) -> Request | None:
    """The running request that gives way; never one in a batch in flight (None when all are)."""
    candidates = [r for r in running if r.request_id not in in_flight] if in_flight else running
    if not candidates:
        return None
    if policy == "priority":
        return max(candidates, key=lambda r: r.sort_key())
    return candidates[-1]            # FCFS: the latest arrival gives way
