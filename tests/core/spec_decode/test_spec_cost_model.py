"""The speculative step cost model (core/spec_decode/cost_model.py) on synthetic step timings: what it learns of a step's
time by row count, and the draft lengths it picks: none where verify rows cost more than they return (a busy,
compute-bound batch, or drafts rarely accepted), the most at one stream with drafts mostly accepted, and more for
the requests whose drafts are accepted more often. Then the scheduler taking its choice."""
from __future__ import annotations

import pytest

from pagedserve.common.config.engine_args import SchedulerConfig
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.common.speculative import parse_speculative_config
from pagedserve.core.block_hash import BlockHasher
from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.core.spec_decode.cost_model import (FORGET_AFTER, StepCostModel, expected_tokens, plan_draft_lengths,
                                             sure_draft_pays)
from pagedserve.ipc.messages import ModelRunnerOutput


def _cpu_like() -> StepCostModel:
    """One stream on the 2-core CPU (docs/speculative_decoding.md): up to 8 rows in the C step at ~0.8 ms a row
    over ~1.9 ms of weights streamed once; from 9 rows the PyTorch layers, and then every row costs a token's
    compute (~0.95 ms)."""
    model = StepCostModel()
    for rows in [*range(1, 9), 16, 32, 64, 128, 256, 320, 384]:
        model.observe(rows, (1.9 + 0.8 * rows if rows <= 8 else 4.0 + 0.95 * rows) / 1000)
    return model


def test_it_learns_a_steps_time_by_row_count():
    model = StepCostModel()
    assert model.cost(6) / model.cost(1) == pytest.approx(2.5)          # the seed's shape before any timing
    model.observe(1, 2.0)
    model.observe(5, 4.0)
    assert model.cost(1) == 2.0 and model.cost(5) == 4.0
    assert model.cost(3) == pytest.approx(3.0)                          # linear between timed row counts
    assert model.cost(7) == pytest.approx(4.0 * 2.8 / 2.2)              # the seed's shape beyond them
    model.observe(1, 3.0)
    assert model.cost(1) == pytest.approx(2.2)                          # an average of its timings
    model.observe(1, 1000.0)                                            # a stall counts as 3x the average
    assert model.cost(1) == pytest.approx(2.2 + 0.2 * (6.6 - 2.2))
    model.observe(1000, 0.5)
    model.observe(1002, 0.5)
    assert model.num_row_counts == 3                                    # large steps share a bucket
    assert model.cost(2000) == pytest.approx(0.5 * 600.7 / 300.82)      # at its average row count, 1000.4


def test_a_row_count_not_timed_for_long_is_forgotten():
    model = StepCostModel()
    model.observe(6, 1.0)                                               # looked dear once (a busy moment)
    for _ in range(FORGET_AFTER + 64):
        model.observe(1, 0.002)
    assert model.num_row_counts == 1 and model.cost(6) == pytest.approx(0.002 * 2.5)    # estimated afresh


def test_expected_tokens_of_a_draft():
    assert expected_tokens(0.5, 0) == 1 and expected_tokens(0.5, 3) == pytest.approx(1.875)
    assert expected_tokens(1.0, 5) == 6


def test_one_stream_with_drafts_mostly_accepted_drafts_the_most():
    model = _cpu_like()
    assert plan_draft_lengths(model.cost, 1, 1, [0.9], [5], 5) == [5]
    assert plan_draft_lengths(model.cost, 1, 1, [0.75], [5], 5) == [2]  # the later drafts return less than a row
    assert plan_draft_lengths(model.cost, 1, 1, [0.3], [5], 5) == [0]   # rarely accepted: no drafts pay
    assert plan_draft_lengths(model.cost, 1, 1, [0.9], [2], 5) == [2]   # no more than the lookup found


def test_a_busy_batch_drafts_nothing():
    """64 requests decode: the step is compute-bound, each verify row costs what a token does, and a draft returns
    less than one: no drafts, however many the bounds would allow, even at high acceptance."""
    model = _cpu_like()
    assert plan_draft_lengths(model.cost, 64, 64, [0.8] * 64, [5] * 64, 320) == [0] * 64
    assert not sure_draft_pays(model.cost, 64, 64)                      # nor a probe: a sure token does not pay
    assert sure_draft_pays(model.cost, 1, 1)


def test_the_rows_go_where_drafts_are_accepted_most():
    gpu_like = StepCostModel()          # weight-bound far past these row counts: a row is nearly free
    for rows in (1, 16):
        gpu_like.observe(rows, 0.010 + 0.0001 * rows)
    assert plan_draft_lengths(gpu_like.cost, 2, 2, [0.95, 0.4], [5, 5], 5) == [5, 0]
    assert plan_draft_lengths(gpu_like.cost, 2, 2, [0.95, 0.4], [5, 5], 7) == [5, 2]
    assert plan_draft_lengths(gpu_like.cost, 2, 2, [0.0, 0.0], [5, 5], 7) == [0, 0]
    assert plan_draft_lengths(gpu_like.cost, 2, 2, [0.9, 0.9], [0, 0], 7) == [0, 0]


# ---------------------------------------------------------------- the scheduler takes its choice


def _scheduler(disable_by_batch_size: int) -> Scheduler:
    cfg = SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=64, max_model_len=256, policy="fcfs",
                          enable_chunked_prefill=True, max_waiting_requests=None, async_scheduling=False,
                          batch_queue_size=1, max_loras=0)
    spec = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_min": 1,
                                     "prompt_lookup_max": 3, "disable_by_batch_size": disable_by_batch_size})
    return Scheduler(cfg, KVCacheManager(1024, 4, False), speculative=spec)


def _decoding(sched: Scheduler, n: int) -> list[Request]:
    """n requests past their prompts of a repeated pattern (the lookup finds 5 drafts for each)."""
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    reqs = [Request(f"r{i}", [7, 8, 9] * 5, params, eos_token_ids=(0,), max_tokens=50, block_hasher=BlockHasher(4))
            for i in range(n)]
    for r in reqs:
        sched.add_request(r)
    out = sched.schedule()
    sched.update_from_output(out, ModelRunnerOutput(list(out.num_scheduled_tokens), [7] * n))
    return reqs


def test_the_scheduler_drafts_for_one_stream_and_not_for_a_busy_batch():
    one = _scheduler(disable_by_batch_size=64)
    one.spec.cost = _cpu_like()
    _decoding(one, 1)
    # at the engine's seed acceptance (0.8 a position) a fourth draft would add less than its row costs
    assert one.schedule().scheduled_spec_decode_tokens == {"r0": [8, 9, 7]}
    busy = _scheduler(disable_by_batch_size=64)
    busy.spec.cost = _cpu_like()
    _decoding(busy, 64)
    out = busy.schedule()
    assert out.scheduled_spec_decode_tokens == {} and out.total_num_scheduled_tokens == 64
