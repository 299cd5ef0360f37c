"""Scheduler and KV cache manager: budgets, preemption, prefix hits, blocks always returned."""
from __future__ import annotations

import pytest

from pagedserve.core.block_hash import BlockHasher
from pagedserve.common.config.engine_args import SchedulerConfig
from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request, RequestStatus
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.ipc.messages import ModelRunnerOutput, SchedulerOutput

BS = 4


def make_scheduler(num_blocks=64, budget=64, max_seqs=16, caching=True, policy="fcfs", chunked=True):
    kv = KVCacheManager(num_blocks, BS, caching)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256,
                          policy=policy, enable_chunked_prefill=chunked, max_waiting_requests=None,
                          async_scheduling=False, batch_queue_size=1, max_loras=0)
    return Scheduler(cfg, kv)


def make_request(rid, prompt, max_tokens=4, priority=0, arrival=None, caching=True, **kw):
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(rid, list(prompt), params, eos_token_ids=(0,), max_tokens=max_tokens,
                   block_hasher=BlockHasher(BS) if caching else None, arrival_time=arrival, priority=priority)


def fake_step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    """Run one step, answering every request that caught up with `token` (what a model runner does)."""
    out = sched.schedule()
    req_ids, tokens = [], []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        req_ids.append(rid)
        tokens.append(token if req.num_computed_tokens >= req.num_tokens else -1)
    return out, sched.update_from_output(out, ModelRunnerOutput(req_ids, tokens))


def run_to_completion(sched: Scheduler, max_steps=1000) -> list[SchedulerOutput]:
    outs = []
    for _ in range(max_steps):
        if not sched.has_unfinished_requests():
            return outs
        outs.append(fake_step(sched)[0])
    raise AssertionError("requests did not finish")


def test_token_budget_and_max_num_seqs_respected():
    sched = make_scheduler(budget=10, max_seqs=3)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", range(1, 9), max_tokens=3))
    for out in run_to_completion(sched):
        assert out.total_num_scheduled_tokens <= 10
        assert sum(out.num_scheduled_tokens.values()) == out.total_num_scheduled_tokens
        assert len(out.num_scheduled_tokens) <= 3
    assert sched.kv.num_free_blocks == 64


def test_long_prompt_is_chunked_across_steps():
    sched = make_scheduler(budget=8)
    sched.add_request(make_request("long", range(1, 21), max_tokens=2))
    chunks = [fake_step(sched)[0].num_scheduled_tokens["long"] for _ in range(3)]
    assert chunks == [8, 8, 4]
    assert sched.requests["long"].num_output_tokens == 1


def test_decodes_scheduled_before_waiting_prefills():
    sched = make_scheduler(budget=6)
    sched.add_request(make_request("a", range(1, 5), max_tokens=10))
    fake_step(sched)                      # a: prefill 4 tokens, samples one
    sched.add_request(make_request("b", range(10, 30), max_tokens=2))
    out, _ = fake_step(sched)
    assert out.num_scheduled_tokens == {"a": 1, "b": 5}


def test_preemption_recomputes_latest_request_and_frees_everything():
    # 6 blocks of 4 tokens; each request grows to 12 tokens = 3 blocks: three cannot all fit.
    sched = make_scheduler(num_blocks=6, budget=64, caching=False)
    for i in range(3):
        sched.add_request(make_request(f"r{i}", range(1 + 10 * i, 5 + 10 * i), max_tokens=8, caching=False))
    preempted_order = []
    for _ in range(200):
        if not sched.has_unfinished_requests():
            break
        before = sched.num_preemptions
        fake_step(sched)
        if sched.num_preemptions > before:
            preempted_order.append([r.request_id for r in sched.waiting][0])
    assert not sched.has_unfinished_requests()
    assert sched.num_preemptions > 0
    assert preempted_order[0] == "r2"      # FCFS: the latest arrival gives way first
    assert sched.kv.num_free_blocks == 6


def test_priority_policy_preempts_lowest_priority():
    sched = make_scheduler(num_blocks=6, caching=False, policy="priority")
    sched.add_request(make_request("low", range(1, 5), max_tokens=8, priority=5, arrival=1.0, caching=False))
    sched.add_request(make_request("high", range(20, 24), max_tokens=8, priority=0, arrival=2.0, caching=False))
    sched.add_request(make_request("mid", range(40, 44), max_tokens=8, priority=1, arrival=3.0, caching=False))
    first, _ = fake_step(sched)
    assert list(first.num_scheduled_tokens) == ["high", "mid", "low"]
    while sched.num_preemptions == 0:
        fake_step(sched)
    assert sched.requests["low"].status == RequestStatus.PREEMPTED
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 6


def test_prefix_cache_hits_reuse_blocks_and_count():
    sched = make_scheduler(num_blocks=32)
    prefix = list(range(100, 112))          # 3 full blocks
    sched.add_request(make_request("a", prefix + [1, 2], max_tokens=2))
    run_to_completion(sched)
    sched.add_request(make_request("b", prefix + [3, 4, 5], max_tokens=2))
    out, _ = fake_step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 12
    assert out.num_scheduled_tokens["b"] == 3
    assert sched.kv.prefix_stats.hits == 12
    assert sched.requests["b"].num_cached_tokens == 12
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 32


def test_prefix_hit_leaves_last_token_to_compute():
    sched = make_scheduler()
    prompt = list(range(50, 58))           # exactly 2 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    out, _ = fake_step(sched)
    assert out.num_scheduled_tokens["b"] == 4   # only one block may be reused: the last token must run


def test_same_step_siblings_share_prompt_blocks():
    sched = make_scheduler(num_blocks=32)
    prompt = list(range(200, 217))         # 4 full blocks + 1
    sched.add_request(make_request("p#0", prompt, max_tokens=2))
    sched.add_request(make_request("p#1", prompt, max_tokens=2))
    out, _ = fake_step(sched)
    assert out.num_scheduled_tokens == {"p#0": 17, "p#1": 1}
    shared = set(sched.kv.get_block_ids("p#0")[:4])
    assert shared == set(sched.kv.get_block_ids("p#1")[:4])
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 32


def test_cached_free_blocks_evicted_lru():
    sched = make_scheduler(num_blocks=8)
    sched.add_request(make_request("a", range(1, 9), max_tokens=1))   # 2 blocks + 1 for the output slot
    run_to_completion(sched)
    assert len(sched.kv.pool.cached) == 2
    sched.add_request(make_request("big", range(300, 329), max_tokens=1))  # 29 tokens = 8 blocks: evicts all
    run_to_completion(sched)
    sched.add_request(make_request("a2", range(1, 9), max_tokens=1))
    out, _ = fake_step(sched)
    assert out.scheduled_new_reqs[0].num_computed_tokens == 0


def test_abort_frees_blocks_running_and_waiting():
    sched = make_scheduler(num_blocks=16, max_seqs=1)
    sched.add_request(make_request("run", range(1, 10), max_tokens=50))
    sched.add_request(make_request("wait", range(1, 10), max_tokens=50))
    fake_step(sched)
    assert sched.requests["run"].status == RequestStatus.RUNNING
    done = sched.finish_requests(["run", "wait", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert {r.request_id for r in done} == {"run", "wait"}
    assert sched.kv.num_free_blocks == 16
    assert sched.schedule().finished_req_ids == ["run"]   # the worker drops what it held


def test_stop_token_and_min_tokens():
    sched = make_scheduler()
    req = Request("s", [1, 2, 3], SamplingParams(max_tokens=10, min_tokens=2, stop_token_ids=[7]),
                  eos_token_ids=(0,), max_tokens=10, block_hasher=None)
    sched.add_request(req)
    fake_step(sched, token=7)               # below min_tokens: the stop token does not end it
    assert req.status == RequestStatus.RUNNING
    _, outs = fake_step(sched, token=7)
    assert outs[0].finish_reason == "stop" and outs[0].stop_reason == 7


def test_no_chunking_waits_for_budget():
    sched = make_scheduler(budget=16, chunked=False)
    sched.add_request(make_request("a", range(1, 11), max_tokens=3))
    sched.add_request(make_request("b", range(20, 30), max_tokens=3))
    out, _ = fake_step(sched)
    assert out.num_scheduled_tokens == {"a": 10}


@pytest.mark.parametrize("caching", [True, False])
def test_blocks_all_return_after_mixed_finish_and_abort(caching):
    sched = make_scheduler(num_blocks=20, budget=16, caching=caching)
    for i in range(6):
        sched.add_request(make_request(f"r{i}", list(range(1, 6 + 3 * i)), max_tokens=5 + i, caching=caching))
    for step in range(6):
        fake_step(sched)
        if step == 2:
            sched.finish_requests(["r1", "r4"], RequestStatus.FINISHED_ABORTED)
    run_to_completion(sched)
    assert sched.kv.num_free_blocks == 20
    assert all(b.ref_cnt == 0 for b in sched.kv.pool.blocks)
