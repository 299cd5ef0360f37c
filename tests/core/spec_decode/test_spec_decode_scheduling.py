"""Speculative decoding in the engine core: the config, the n-gram proposer, the scheduler's drafts, rollback
of rejected drafts' KV slots and the prefix cache, and the stats."""
from __future__ import annotations

import pytest

from pagedserve.common.config.engine_args import EngineArgs, SchedulerConfig
from pagedserve.common.speculative import DEFAULT_PROMPT_LOOKUP, parse_speculative_config
from pagedserve.core.block_hash import BlockHasher
from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.core.spec_decode.ngram_proposer import propose_ngram
from pagedserve.core.request import Request, RequestStatus
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.cli import parse_args
from pagedserve.ipc.messages import ModelRunnerOutput

BS = 4


# ---------------------------------------------------------------- the config


def test_config_takes_vllms_keys_and_defaults():
    cfg = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 4,
                                    "prompt_lookup_min": 2})
    assert (cfg.method, cfg.num_speculative_tokens, cfg.prompt_lookup_min, cfg.prompt_lookup_max) == ("ngram", 5, 2, 4)
    one = parse_speculative_config('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}')
    assert (one.prompt_lookup_min, one.prompt_lookup_max) == (3, 3)          # the unset one takes the other's
    both = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 3})
    assert both.prompt_lookup_min == both.prompt_lookup_max == DEFAULT_PROMPT_LOOKUP
    assert parse_speculative_config(None) is None


@pytest.mark.parametrize("value,field", [
    ({"method": "medusa2", "num_speculative_tokens": 3}, "speculative_config.method"),
    ({"num_speculative_tokens": 3}, "speculative_config.method"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram"}, "speculative_config.num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "speculative_config.prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 2, "lookahead": 3}, "lookahead"),
    ({"method": "mtp", "num_speculative_tokens": 2}, "speculative_config.method"),
    ({"method": "eagle", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "num_speculative_tokens": 2}, "speculative_config.model"),
    ({"method": "draft_model", "model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
     "speculative_config.draft_tensor_parallel_size"),
    ({"method": "ngram", "model": "x", "num_speculative_tokens": 2}, "speculative_config.model"),
    ("{not json", "speculative_config"),
])
def test_bad_configs_are_refused_naming_the_field(value, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        parse_speculative_config(value)
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        EngineArgs(speculative_config=value).validate()          # refused before anything starts


def test_the_flag_is_vllms_json():
    engine, _ = parse_args(["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 4}'])
    assert engine.speculative_config == {"method": "ngram", "num_speculative_tokens": 4}
    with pytest.raises(SystemExit):
        parse_args(["--speculative-config", "[1, 2]"])


# ---------------------------------------------------------------- the proposer


def test_ngram_drafts_what_followed_the_latest_match_of_the_longest_suffix():
    tokens = [5, 6, 7, 8, 1, 2, 9, 6, 7, 3, 4, 6, 7]
    # suffix [6, 7]: latest earlier occurrence at index 7 -> followed by 3, 4, 6, 7
    assert propose_ngram(tokens, 3, 1, 3) == [3, 4, 6]
    # the longest suffix first: [4, 6, 7] is nowhere earlier, [6, 7] is
    assert propose_ngram(tokens, 10, 2, 3) == [3, 4, 6, 7]
    assert propose_ngram([1, 2, 3, 4], 3, 1, 3) == []                     # nothing repeats
    assert propose_ngram([1, 2, 1], 3, 2, 3) == []                        # too short for n = 2
    assert propose_ngram([1, 2, 1], 3, 1, 3) == [2, 1]                    # n = 1: the draft runs to the end


# ---------------------------------------------------------------- the scheduler


def _scheduler(k: int = 3, disable_by_batch_size: int = 8, budget: int = 64, max_seqs: int = 16,
               method: str = "ngram"):
    kv = KVCacheManager(64, BS, True)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_seqs, max_model_len=256, policy="fcfs",
                          enable_chunked_prefill=True, max_waiting_requests=None, async_scheduling=False,
                          batch_queue_size=1, max_loras=0)
    # draft_model: the workers' draft model proposes (it never loads here: the scheduler only reads the config)
    extra = {"prompt_lookup_min": 1, "prompt_lookup_max": 3} if method == "ngram" else {"model": "unused"}
    spec = parse_speculative_config({"method": method, "num_speculative_tokens": k,
                                     "disable_by_batch_size": disable_by_batch_size, **extra})
    return Scheduler(cfg, kv, speculative=spec)


def _request(rid: str, prompt: list[int], max_tokens: int = 20, **kw) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, **kw)
    return Request(rid, prompt, params, eos_token_ids=(0,), max_tokens=max_tokens, block_hasher=BlockHasher(BS))


def _answer(sched: Scheduler, out, sampled: dict[str, int], accepted: dict[str, list[int]] | None = None):
    rids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(rids, [sampled.get(r, -1) for r in rids],
                               spec_token_ids=[(accepted or {}).get(r, []) for r in rids])
    return sched.update_from_output(out, result)


def test_drafts_are_scheduled_verified_and_rejected_slots_rolled_back():
    sched = _scheduler(k=3)
    req = _request("a", [1, 2, 3, 1, 2, 3, 1, 2])
    sched.add_request(req)
    out = sched.schedule()                                   # the prompt
    assert out.scheduled_spec_decode_tokens == {}
    _answer(sched, out, {"a": 3})
    assert req.num_computed_tokens == 8 and req.num_tokens == 9
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [1, 2, 3]}     # after ... 1 2 3 came 1 2 3
    assert out.num_scheduled_tokens == {"a": 4}                       # its token + 3 drafts
    outputs = _answer(sched, out, {"a": 9}, {"a": [1, 2]})            # two accepted, 9 sampled after them
    assert outputs[0].new_token_ids == [1, 2, 9]
    assert req.output_token_ids == [3, 1, 2, 9]
    # position 11 held the rejected draft: the request counts 11 computed tokens, not 12
    assert req.num_computed_tokens == 11 == req.num_tokens - 1
    stats = sched.make_stats()
    assert (stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens) == (1, 3, 2)
    assert stats.spec_accepted_per_pos == [1, 1, 0]


def test_prefix_cache_holds_only_blocks_of_real_tokens():
    sched = _scheduler(k=3)
    req = _request("a", [1, 2, 3, 1, 2, 3, 1, 2])
    sched.add_request(req)
    _answer(sched, sched.schedule(), {"a": 3})
    out = sched.schedule()
    _answer(sched, out, {"a": 9}, {"a": [1, 2]})          # position 11 held the rejected draft 3
    out = sched.schedule()                                 # computes position 11 (token 9) now
    pool = sched.kv.pool
    cached_blocks = {b.block_id: h for h, b in pool.cached.items()}
    assert len(cached_blocks) == 3
    # Every cached block's hash is the hash of the request's real tokens there, block 2 = [3, 1, 2, 9]
    assert [cached_blocks[b] for b in sched.kv.get_block_ids("a")[:3]] == req.block_hashes[:3]
    assert req.all_token_ids[8:12] == [3, 1, 2, 9]
    assert out.num_scheduled_tokens["a"] >= 1


def test_tokens_past_a_stop_or_max_tokens_are_never_emitted_and_blocks_return():
    sched = _scheduler(k=3)
    free = sched.kv.num_free_blocks
    req = _request("a", [1, 2, 3, 1, 2, 3, 1, 2], max_tokens=3)
    sched.add_request(req)
    _answer(sched, sched.schedule(), {"a": 3})
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [1]}    # max_tokens 3: room for one draft and one token
    outputs = _answer(sched, out, {"a": 5}, {"a": [1]})
    assert outputs[0].new_token_ids == [1, 5] and outputs[0].finish_reason == "length"
    assert req.output_token_ids == [3, 1, 5]
    stop = _request("b", [1, 2, 3, 1, 2, 3, 1, 2], stop_token_ids=[2])
    sched.add_request(stop)
    _answer(sched, sched.schedule(), {"b": 3})
    out = sched.schedule()
    outputs = _answer(sched, out, {"b": 3}, {"b": [1, 2]})    # the stop id 2 is accepted mid-draft
    assert outputs[0].new_token_ids == [1, 2] and outputs[0].finish_reason == "stop"
    assert stop.status == RequestStatus.FINISHED_STOPPED
    sched.schedule()
    assert sched.kv.num_free_blocks == free


def test_the_steps_drafts_shrink_with_load_and_stop_past_the_batch_bound():
    sched = _scheduler(k=4, disable_by_batch_size=3)
    reqs = [_request(f"r{i}", [7, 8, 9, 7, 8, 9, 7, 8]) for i in range(4)]
    for r in reqs[:2]:
        sched.add_request(r)
    _answer(sched, sched.schedule(), {"r0": 9, "r1": 9})
    out = sched.schedule()
    # k = 4 draft tokens per step in all; the two requests' acceptance is the same, so each gets two (a request's
    # second draft adds less than the other's first would)
    assert out.scheduled_spec_decode_tokens == {"r0": [7, 8], "r1": [7, 8]}
    _answer(sched, out, {"r0": 1, "r1": 1}, {"r0": []})
    for r in reqs[2:]:
        sched.add_request(r)
    out = sched.schedule()
    _answer(sched, out, {r.request_id: 9 for r in reqs})
    out = sched.schedule()                                    # 4 running > disable_by_batch_size 3
    assert out.scheduled_spec_decode_tokens == {}


def test_a_request_whose_drafts_keep_failing_gets_fewer_then_only_probes():
    sched = _scheduler(k=4)
    req = _request("a", [5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6], max_tokens=60)
    sched.add_request(req)
    _answer(sched, sched.schedule(), {"a": 7})
    sizes = []
    for _ in range(12):
        out = sched.schedule()
        sizes.append(len(out.scheduled_spec_decode_tokens.get("a", [])))
        _answer(sched, out, {"a": 7 if req.num_output_tokens % 3 else 5}, {"a": []})     # every draft rejected
    assert sizes[0] == 3 and sizes[2] < 3                  # the lookup's 3, then less as acceptance falls
    assert max(sizes[6:]) <= 1 and sum(sizes[6:]) < 6      # then only one-token probes, now and then
    assert sched.spec.acceptance(req) < 0.15


# ---------------------------------------------------------------- what the workers' draft model proposes


def _answer_with_proposals(sched: Scheduler, out, sampled: dict[str, int], accepted: dict[str, list[int]]):
    """The workers' output, their draft model proposing the token 7 as often as the core asked."""
    rids = list(out.num_scheduled_tokens)
    result = ModelRunnerOutput(rids, [sampled.get(r, -1) for r in rids],
                               spec_token_ids=[accepted.get(r, []) for r in rids],
                               draft_token_ids=[[7] * out.num_draft_tokens_to_propose.get(r, 0) for r in rids])
    return sched.update_from_output(out, result)


def test_the_draft_model_is_asked_for_what_the_next_step_can_verify():
    from pagedserve.tests.helpers.spec_costs import FixedStepCosts
    sched = _scheduler(k=3, disable_by_batch_size=2, method="draft_model")
    sched.spec.cost = FixedStepCosts()                  # a verify row is free: every draft that may be accepted pays
    a = _request("a", [1, 2, 3, 4], max_tokens=6)
    sched.add_request(a)
    out = sched.schedule()                              # the prompt: a samples now, decodes next step
    assert out.num_draft_tokens_to_propose == {"a": 3}
    _answer_with_proposals(sched, out, {"a": 5}, {})
    out = sched.schedule()
    assert out.scheduled_spec_decode_tokens == {"a": [7, 7, 7]}
    # after this step a has at least 2 of its 6 tokens and the next may verify 3 drafts; then 5 of 6: none
    assert out.num_draft_tokens_to_propose == {"a": 3}
    _answer_with_proposals(sched, out, {"a": 9}, {"a": [7, 7]})
    assert a.num_output_tokens == 4
    assert sched.schedule().num_draft_tokens_to_propose == {}
    # more requests than disable_by_batch_size: no proposals for any
    sched = _scheduler(k=3, disable_by_batch_size=2, method="draft_model")
    sched.spec.cost = FixedStepCosts()
    for rid in "bcd":
        sched.add_request(_request(rid, [1, 2, 3, 4]))
    assert sched.schedule().num_draft_tokens_to_propose == {}
    # drafts that cannot pay (a verify row costs a step): none, nor a probe, at any step
    sched = _scheduler(k=3, method="draft_model")
    sched.spec.cost = FixedStepCosts(per_row=1000.0)
    e = _request("e", [1, 2, 3, 4], max_tokens=30)
    sched.add_request(e)
    for _ in range(20):
        out = sched.schedule()
        assert out.num_draft_tokens_to_propose == {} and out.scheduled_spec_decode_tokens == {}
        _answer_with_proposals(sched, out, {"e": 5}, {})
    assert e.num_output_tokens == 20


def test_the_draft_model_is_asked_at_least_what_the_next_plan_takes_probes_included():
    """Every draft rejected, the step cost model's seed curve: the proposals asked shrink with the acceptance,
    to none but the probes; before each step, the plan the core would make had the request a full-length
    proposal takes no more than was asked after the step before."""
    sched = _scheduler(k=4, method="draft_model")
    req = _request("a", [5, 6, 7, 5, 6, 7, 5, 6], max_tokens=80)
    sched.add_request(req)
    out = sched.schedule()
    asked, wanted = [], []
    for step in range(40):
        _answer_with_proposals(sched, out, {"a": 3}, {"a": []})
        asked.append(out.num_draft_tokens_to_propose.get("a", 0))
        proposed = list(req.spec_token_ids)
        req.spec_token_ids = [7] * 4                     # what a full-length proposal would have let it verify
        budget = sched.config.max_num_batched_tokens
        sched.spec.plan(sched.running, budget)
        wanted.append(len(sched.spec.drafts_for(req, budget, 0)))
        req.spec_token_ids = proposed
        out = sched.schedule()
        assert len(out.scheduled_spec_decode_tokens.get("a", [])) == wanted[-1] <= asked[-1], (step, asked, wanted)
    assert asked[0] == wanted[0] == 3                    # at the seed acceptance, 3 drafts pay
    assert asked[10:].count(0) >= 20                     # no proposal pass at most steps once drafts fail
    assert wanted[10:].count(1) >= 3                     # but the probes still get theirs
