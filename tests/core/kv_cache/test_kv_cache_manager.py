"""KVCacheManager: prefix hits through chained block hashes, slot allocation all-or-nothing, frees, stats.

Requests are real `Request`s hashed by a real BlockHasher; a "step" here is what the scheduler does for a
waiting request: look up its cached prefix, allocate slots for the rest, mark everything computed.
"""
from __future__ import annotations

import pytest

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.core.block_hash import BlockHasher
from pagedserve.core.kv_cache.kv_cache_manager import KVCacheManager
from pagedserve.core.request import Request

BS = 4


def make_request(rid: str, tokens: list[int], caching: bool = True) -> Request:
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    return Request(rid, list(tokens), params, eos_token_ids=(0,), max_tokens=8,
                   block_hasher=BlockHasher(BS) if caching else None)


def schedule_prefill(kv: KVCacheManager, req: Request) -> int:
    """Prefix lookup + allocation for the whole prompt, as the scheduler does; the cached token count."""
    hits, num_hit_tokens = kv.get_computed_blocks(req)
    new = kv.allocate_slots(req, req.num_tokens - num_hit_tokens, hits, num_hit_tokens)
    assert new is not None, "pool too small for the test's request"
    req.num_computed_tokens = req.num_tokens
    return num_hit_tokens


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("prompt_len, expect_hit", [(8, 4), (9, 8), (12, 8), (13, 12)])
def test_prefix_hit_always_leaves_a_token_to_compute(prompt_len, expect_hit):
    """The last prompt token must run through the model for its logits, even when its block is cached."""
    kv = KVCacheManager(16, BS, enable_caching=True)
    schedule_prefill(kv, make_request("a", seq(100, 16)))
    hits, n = kv.get_computed_blocks(make_request("b", seq(100, prompt_len)))
    assert n == expect_hit and len(hits) == expect_hit // BS
    assert n < prompt_len


def test_requests_sharing_a_prefix_share_its_blocks():
    kv = KVCacheManager(16, BS, enable_caching=True)
    prefix = seq(100, 8)
    a, b = make_request("a", prefix + [1, 2, 3]), make_request("b", prefix + [7, 8, 9, 10, 11])
    assert schedule_prefill(kv, a) == 0
    assert schedule_prefill(kv, b) == 8
    assert kv.get_block_ids("b")[:2] == kv.get_block_ids("a")[:2]
    assert kv.get_block_ids("b")[2:] != kv.get_block_ids("a")[2:]
    assert [blk.ref_cnt for blk in kv.req_to_blocks["b"][:2]] == [2, 2]
    assert kv.num_free_blocks == 16 - 3 - 2       # a: 3 blocks, b: 2 shared + 2 of its own


def test_same_block_tokens_after_a_different_prefix_do_not_hit():
    """Hashes are chained: a block is identified by its tokens AND every token before it."""
    kv = KVCacheManager(16, BS, enable_caching=True)
    first, second = seq(100, BS), seq(200, BS)
    a = make_request("a", first + second + [1])
    schedule_prefill(kv, a)
    b = make_request("b", seq(300, BS) + second + [1])     # block 2 has a's tokens, block 1 differs
    assert b.block_hashes[1] != a.block_hashes[1]
    assert kv.pool.get_cached_block(b.block_hashes[1]) is None
    assert kv.get_computed_blocks(b) == ([], 0)
    # Only the first block matches a request whose second block differs.
    c = make_request("c", first + seq(400, BS) + [1])
    hits, n = kv.get_computed_blocks(c)
    assert n == BS and [blk.block_id for blk in hits] == kv.get_block_ids("a")[:1]


def test_only_full_blocks_are_registered_in_the_prefix_cache():
    kv = KVCacheManager(16, BS, enable_caching=True)
    a = make_request("a", seq(100, 10))                   # 2 full blocks + 2 tokens
    schedule_prefill(kv, a)
    assert set(kv.pool.cached) == set(a.block_hashes) and len(a.block_hashes) == 2
    blocks = kv.req_to_blocks["a"]
    assert [b.block_hash for b in blocks] == [*a.block_hashes, None]
    # Decoding fills the third block: it is registered once the allocation covers its last token.
    for token in (1, 2):
        a.append_output_token(token)
        assert kv.allocate_slots(a, 1) == []              # still inside block 3: no new block
        a.num_computed_tokens += 1
    assert len(a.block_hashes) == 3 and blocks[2].block_hash == a.block_hashes[2]


def test_decode_takes_a_new_block_only_at_a_block_boundary():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = make_request("a", seq(100, BS))
    schedule_prefill(kv, a)
    assert len(kv.req_to_blocks["a"]) == 1
    a.append_output_token(5)
    new = kv.allocate_slots(a, 1)
    assert new is not None and len(new) == 1 and kv.get_block_ids("a")[-1] == new[0].block_id


def test_allocate_slots_returns_none_and_changes_nothing_when_the_pool_is_short():
    kv = KVCacheManager(4, BS, enable_caching=True)
    schedule_prefill(kv, make_request("a", seq(100, 3 * BS)))
    free_before = kv.num_free_blocks
    b = make_request("b", seq(500, 2 * BS))
    assert kv.allocate_slots(b, b.num_tokens) is None
    assert kv.num_free_blocks == free_before == 1
    assert "b" not in kv.req_to_blocks and kv.get_block_ids("b") == []


def test_short_pool_with_free_prefix_hits_leaves_the_hits_cached_and_free():
    """Hit blocks nobody holds sit in the free queue: taking them uses free capacity. When the rest does
    not fit, the hits must stay untouched (unreferenced, still cached, still evictable)."""
    kv = KVCacheManager(4, BS, enable_caching=True)
    a = make_request("a", seq(100, 2 * BS) + [1])
    schedule_prefill(kv, a)                               # 3 blocks, 2 of them cached
    kv.free(a)
    schedule_prefill(kv, make_request("c", seq(900, 1)))  # holds 1 of the 4 blocks
    b = make_request("b", seq(100, 2 * BS) + seq(700, 2 * BS))
    hits, n = kv.get_computed_blocks(b)
    assert n == 2 * BS
    assert kv.allocate_slots(b, b.num_tokens - n, hits, n) is None   # 2 hits + 2 new > 3 free
    assert [blk.ref_cnt for blk in hits] == [0, 0]
    assert all(kv.pool.get_cached_block(h) is not None for h in a.block_hashes)
    assert kv.num_free_blocks == 3 and "b" not in kv.req_to_blocks


def test_running_request_short_of_blocks_keeps_the_ones_it_has():
    kv = KVCacheManager(2, BS, enable_caching=True)
    a = make_request("a", seq(100, 2 * BS))
    schedule_prefill(kv, a)
    before = kv.get_block_ids("a")
    a.append_output_token(5)
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids("a") == before and all(b.ref_cnt == 1 for b in kv.req_to_blocks["a"])


def test_free_returns_every_block_tail_first():
    """Freed tail-first, a request's last blocks are evicted before its prefix, which others may share."""
    kv = KVCacheManager(3, BS, enable_caching=True)
    a = make_request("a", seq(100, 3 * BS))
    schedule_prefill(kv, a)
    order = kv.get_block_ids("a")
    kv.free(a)
    assert kv.num_free_blocks == 3 and kv.usage == 0.0
    assert [b.block_id for b in kv.pool.free_queue] == order[::-1]
    assert kv.get_block_ids("a") == []
    # One new block evicts a's last block; its first two stay cached and hit.
    schedule_prefill(kv, make_request("x", seq(900, 1)))
    assert kv.get_block_ids("x") == [order[2]]
    hits, n = kv.get_computed_blocks(make_request("b", seq(100, 3 * BS)))
    assert [blk.block_id for blk in hits] == order[:2] and n == 2 * BS


def test_free_of_a_sharer_keeps_the_shared_blocks_for_the_other():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a, b = make_request("a", seq(100, 2 * BS) + [1]), make_request("b", seq(100, 2 * BS) + [2])
    schedule_prefill(kv, a)
    schedule_prefill(kv, b)
    shared = kv.req_to_blocks["a"][:2]
    kv.free(b)
    assert [blk.ref_cnt for blk in shared] == [1, 1] and kv.num_free_blocks == 8 - 3
    kv.free(a)
    assert kv.num_free_blocks == 8 and all(blk.ref_cnt == 0 for blk in kv.pool.blocks)


def test_prefix_stats_count_queried_and_hit_tokens():
    kv = KVCacheManager(16, BS, enable_caching=True)
    schedule_prefill(kv, make_request("a", seq(100, 10)))        # 10 queried, 0 hit
    schedule_prefill(kv, make_request("b", seq(100, 10)))        # 10 queried, 8 hit
    schedule_prefill(kv, make_request("c", seq(100, 5)))         # 5 queried, 4 hit
    stats = kv.prefix_stats
    assert (stats.queries, stats.hits) == (25, 12)


def test_without_caching_nothing_hits_nothing_is_counted_and_no_hash_is_kept():
    kv = KVCacheManager(8, BS, enable_caching=False)
    a = make_request("a", seq(100, 9), caching=False)
    schedule_prefill(kv, a)
    kv.free(a)
    b = make_request("b", seq(100, 9), caching=False)
    assert schedule_prefill(kv, b) == 0
    assert kv.pool.cached == {} and (kv.prefix_stats.queries, kv.prefix_stats.hits) == (0, 0)


def test_reset_prefix_cache_waits_for_every_request_to_free():
    kv = KVCacheManager(8, BS, enable_caching=True)
    a = make_request("a", seq(100, 9))
    schedule_prefill(kv, a)
    assert kv.reset_prefix_cache() is False
    kv.free(a)
    assert kv.reset_prefix_cache() is True
    assert kv.get_computed_blocks(make_request("b", seq(100, 9))) == ([], 0)
