"""The scheduler's multimodal part: chunks stop before items whose encoder output cannot be had, items are
encoded once and shared, evicted least recently used, and the prefix cache never shares KV across images."""
from __future__ import annotations

from pagedserve.common.config.engine_args import SchedulerConfig
from pagedserve.common.multimodal.config import MultiModalConfig
from pagedserve.common.multimodal.families import ItemRule
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.core.block_hash import BlockHasher
from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.core.multimodal.encoder_cache import EncoderCacheManager
from pagedserve.core.request import Request
from pagedserve.core.sched.scheduler import Scheduler
from pagedserve.ipc.messages import ModelRunnerOutput, MultiModalFeature, TensorData

BS = 4
ITEM = 8        # placeholder tokens per image


def make_scheduler(budget=64, cache_tokens=16, encoder_budget=None, num_blocks=64, chunked=True, bidirectional=False):
    kv = KVCacheManager(num_blocks, BS, True)
    cfg = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=16, max_model_len=256, policy="fcfs",
                          enable_chunked_prefill=chunked, max_waiting_requests=None, async_scheduling=False,
                          batch_queue_size=1, max_loras=0)
    mm = MultiModalConfig(limit_per_prompt={"image": 4}, processor_kwargs={}, processor_cache_gb=0.0,
                          allowed_local_media_path=None, max_tokens_per_item=ITEM,
                          item_rules={"image": ItemRule({"pixel_values": [1]})},
                          encoder_budget=encoder_budget or cache_tokens, encoder_cache_size=cache_tokens,
                          bidirectional_items=bidirectional)
    return Scheduler(cfg, kv, multimodal=mm)


def image(name: str, offset: int) -> MultiModalFeature:
    return MultiModalFeature(modality="image", mm_hash=name, offset=offset, length=ITEM,
                             data={"pixel_values": TensorData("float32", [1], b"\0\0\0\0")})


def make_request(rid: str, prompt: list[int], items: list[MultiModalFeature], max_tokens: int = 2) -> Request:
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    return Request(rid, list(prompt), params, (0,), max_tokens, BlockHasher(BS), mm_features=items)


def step(sched: Scheduler):
    out = sched.schedule()
    ids, toks = [], []
    for rid, n in out.num_scheduled_tokens.items():
        req = sched.requests[rid]
        ids.append(rid)
        toks.append(7 if req.num_computed_tokens >= req.num_tokens else -1)
    sched.update_from_output(out, ModelRunnerOutput(ids, toks))
    return out


def prompt_with(images: int, text: int = 4) -> tuple[list[int], list[int]]:
    """text tokens, then per image ITEM placeholder tokens (id 99) and text tokens; returns ids and offsets."""
    ids, offsets = list(range(1, text + 1)), []
    for _ in range(images):
        offsets.append(len(ids))
        ids += [99] * ITEM + list(range(10, 10 + text))
    return ids, offsets


def test_an_image_is_encoded_in_the_step_that_first_reaches_it():
    sched = make_scheduler()
    ids, offs = prompt_with(1)
    sched.add_request(make_request("a", ids, [image("x", offs[0])]))
    out = step(sched)
    assert [i.mm_hash for i in out.encoder_inputs] == ["x"]
    assert out.num_scheduled_tokens["a"] == len(ids)
    out = step(sched)        # the decode step encodes nothing
    assert out.encoder_inputs == [] and out.num_scheduled_tokens["a"] == 1


def test_the_encoder_budget_stops_a_chunk_before_the_item_it_cannot_afford():
    sched = make_scheduler(budget=64, cache_tokens=16, encoder_budget=ITEM)    # one image per step
    ids, offs = prompt_with(2)
    sched.add_request(make_request("a", ids, [image("x", offs[0]), image("y", offs[1])]))
    out = step(sched)
    assert [i.mm_hash for i in out.encoder_inputs] == ["x"]
    assert out.num_scheduled_tokens["a"] == offs[1]          # up to, not into, the second image
    out = step(sched)
    assert [i.mm_hash for i in out.encoder_inputs] == ["y"]
    assert out.num_scheduled_tokens["a"] == len(ids) - offs[1]


def test_chunked_prefill_splits_an_image_and_encodes_it_once():
    sched = make_scheduler(budget=6)
    ids, offs = prompt_with(1)
    sched.add_request(make_request("a", ids, [image("x", offs[0])]))
    encoded = []
    while sched.requests["a"].num_output_tokens == 0:
        encoded += [i.mm_hash for i in step(sched).encoder_inputs]
    assert encoded == ["x"]


def test_two_requests_with_one_image_share_its_output_and_the_prefix_cache():
    sched = make_scheduler()
    ids, offs = prompt_with(1)
    sched.add_request(make_request("a", ids, [image("x", offs[0])]))
    sched.add_request(make_request("b", ids + [5], [image("x", offs[0])]))
    out = step(sched)
    assert [i.mm_hash for i in out.encoder_inputs] == ["x"]      # once, though two requests read it
    while sched.requests:
        step(sched)
    sched.add_request(make_request("c", ids, [image("x", offs[0])]))
    step(sched)
    assert sched.requests["c"].num_cached_tokens > offs[0] + ITEM - BS     # the image's blocks came from cache


def test_the_same_text_beside_another_image_shares_no_kv_over_the_image():
    sched = make_scheduler()
    ids, offs = prompt_with(1)
    sched.add_request(make_request("a", ids, [image("x", offs[0])]))
    while sched.requests:
        step(sched)
    sched.add_request(make_request("b", ids, [image("y", offs[0])]))
    out = step(sched)
    assert sched.requests["b"].num_cached_tokens <= offs[0]       # at most the text before the image
    assert [i.mm_hash for i in out.encoder_inputs] == ["y"]


def test_unreferenced_outputs_are_evicted_least_recently_used_and_the_workers_told():
    sched = make_scheduler(cache_tokens=2 * ITEM)
    ids, offs = prompt_with(1)
    for rid, name in (("a", "x"), ("b", "y")):
        sched.add_request(make_request(rid, ids, [image(name, offs[0])]))
        while sched.requests:
            step(sched)
    sched.add_request(make_request("c", ids + [3], [image("z", offs[0])]))
    out = step(sched)
    assert out.free_encoder_mm_hashes == ["x"] and [i.mm_hash for i in out.encoder_inputs] == ["z"]
    assert set(sched.mm.cache.sizes) == {"y", "z"}


def test_an_item_held_by_a_running_request_is_never_evicted():
    cache = EncoderCacheManager(2 * ITEM)
    cache.add("x", ITEM, "a")
    cache.add("y", ITEM, "b")
    assert not cache.can_fit(ITEM)          # both referenced
    cache.release("x", "a")
    assert cache.can_fit(ITEM) and not cache.can_fit(ITEM, keep={"x"})
    cache.add("z", ITEM, "c")
    assert cache.take_freed() == ["x"] and cache.has("y")


def test_without_chunked_prefill_a_prompt_waits_whole_for_its_images():
    sched = make_scheduler(budget=256, cache_tokens=ITEM, chunked=False)
    ids, offs = prompt_with(2)
    sched.add_request(make_request("a", ids, [image("x", offs[0]), image("y", offs[1])]))
    out = sched.schedule()
    assert out.num_scheduled_tokens == {}          # both images cannot be had in one step: nothing partial


def test_a_chunk_over_a_new_item_then_a_cached_one_stops_between_them_when_both_do_not_fit():
    sched = make_scheduler(budget=3 * ITEM, cache_tokens=ITEM + ITEM // 2)     # room for one item only
    ids, offs = prompt_with(2, text=2)
    sched.add_request(make_request("warm", ids[:offs[1]] + ids[offs[1]:offs[1] + ITEM], [image("y", offs[1])]))
    # "warm" has only image y at the second offset; once it is done, y is cached and idle.
    while sched.requests:
        step(sched)
    sched.add_request(make_request("a", ids, [image("x", offs[0]), image("y", offs[1])]))
    out = step(sched)
    assert [i.mm_hash for i in out.encoder_inputs] == ["x"] and out.num_scheduled_tokens["a"] == offs[1]
    while sched.requests:          # and it finishes: y is encoded again once x is done with
        step(sched)


# ---------------------------------------------------------------- whole items (Gemma 3's bidirectional images)

def scheduled_ranges(sched: Scheduler, rid: str) -> list[tuple[int, int]]:
    """Run to the end of the prompt; each step's [start, end) of the request."""
    ranges = []
    while sched.requests[rid].num_computed_tokens < sched.requests[rid].num_prompt_tokens:
        start = sched.requests[rid].num_computed_tokens
        n = step(sched).num_scheduled_tokens.get(rid, 0)
        ranges.append((start, start + n))
    return ranges


def test_a_bidirectional_family_never_splits_an_item_over_chunks():
    ids, offsets = prompt_with(images=2, text=3)        # items at 3 and 14, 8 tokens each
    for bidirectional in (False, True):
        sched = make_scheduler(budget=10, cache_tokens=32, bidirectional=bidirectional)
        sched.add_request(make_request("r", ids, [image(f"h{k}", o) for k, o in enumerate(offsets)]))
        ranges = scheduled_ranges(sched, "r")
        split = [o for o in offsets for a, b in ranges if a < o + ITEM and o < b and not (a <= o and o + ITEM <= b)]
        if bidirectional:
            assert not split and ranges[0] == (0, 3) and (3, 13) in ranges
        else:
            assert split                      # plain chunked prefill cuts an item at the budget


def test_a_prefix_hit_ending_inside_an_item_is_cut_back_before_it():
    # 3 text tokens, an item at 3..10, one text token: a repeat's hit may take 2 blocks of 4 (the last token
    # must run), which would end at 8, inside the item; a bidirectional family's hit stops at the item's start,
    # rounded down to whole blocks: 0
    ids = [1, 2, 3] + [99] * ITEM + [4]
    for bidirectional, want in ((False, 8), (True, 0)):
        sched = make_scheduler(cache_tokens=32, bidirectional=bidirectional)
        sched.add_request(make_request("a", ids, [image("h", 3)], max_tokens=1))
        while sched.requests:
            step(sched)
        sched.add_request(make_request("b", ids, [image("h", 3)]))
        out = sched.schedule()
        assert sched.requests["b"].num_cached_tokens == want
        assert out.num_scheduled_tokens["b"] == len(ids) - want
        assert sched.kv.prefix_stats.hits == want
