"""Pooling requests in the scheduler: prompt-only, finished (blocks freed) by their pooled output, chunked for
last-token pooling, whole in one step for encoders (waiting for room in the budget rather than splitting)."""
from __future__ import annotations

import struct

from pagedserve.common.config.engine_args import SchedulerConfig
from pagedserve.common.params.pooling_params import PoolingParams
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.ipc.messages import ModelRunnerOutput

VECTOR = struct.pack("<2f", 0.6, 0.8)


def make_scheduler(budget: int) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=256, policy="fcfs",
                          enable_chunked_prefill=True, max_waiting_requests=None, async_scheduling=False,
                          batch_queue_size=1, max_loras=0)
    return Scheduler(cfg, KVCacheManager(64, 4, False))


def pooling_request(rid: str, n: int, whole: bool) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=0), (0,), 0, None,
                   pooling_params=PoolingParams(task="embed"), whole_prompt=whole)


def pool_step(sched):
    """One step, answering every request whose prompt completed with a pooled vector (the model runner's part)."""
    out = sched.schedule()
    rids = list(out.num_scheduled_tokens)
    done = [sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens for r in rids]
    result = ModelRunnerOutput(rids, [-1] * len(rids), pooler_output=[VECTOR if d else None for d in done])
    return out, sched.update_from_output(out, result)


def test_last_token_pooling_chunks_then_finishes_with_the_vector():
    sched = make_scheduler(8)
    sched.add_request(pooling_request("a", 20, whole=False))
    steps = [pool_step(sched) for _ in range(3)]
    assert [o.num_scheduled_tokens["a"] for o, _ in steps] == [8, 8, 4]
    assert [len(outs) for _, outs in steps] == [0, 0, 1]
    final = steps[-1][1][0]
    assert final.finish_reason == "stop" and final.pooling_output == VECTOR and final.new_token_ids == []
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 64


def test_whole_prompt_requests_wait_for_room_instead_of_chunking():
    sched = make_scheduler(10)
    for rid, n in (("a", 6), ("b", 6), ("c", 3)):
        sched.add_request(pooling_request(rid, n, whole=True))
    first, _ = pool_step(sched)
    assert first.num_scheduled_tokens == {"a": 6}          # b does not fit whole; c waits behind it (FCFS)
    second, outs = pool_step(sched)
    assert second.num_scheduled_tokens == {"b": 6, "c": 3}
    assert sorted(o.request_id for o in outs) == ["b", "c"]
    assert not sched.has_unfinished_requests() and sched.kv.num_free_blocks == 64
