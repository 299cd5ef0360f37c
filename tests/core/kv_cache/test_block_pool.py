"""BlockPool: allocation order, ref counts, the free queue (LRU eviction, O(1) removal), prefix-cache hashes."""
from __future__ import annotations

import time

import pytest

from pagedserve.core.kv_cache.block_pool import BlockPool, KVCacheBlock


def ids(blocks) -> list[int]:
    return [b.block_id for b in blocks]


def h(i: int) -> bytes:
    """A stand-in block hash (the pool only keys a dict by it)."""
    return i.to_bytes(16, "little")


def cached_and_freed(pool: BlockPool, n: int) -> list[KVCacheBlock]:
    """Allocate n blocks, register hash h(i) for block i, free them in order: n cached free blocks."""
    blocks = pool.get_new_blocks(n)
    for i, block in enumerate(blocks):
        pool.cache_block(block, h(i))
    pool.free_blocks(blocks)
    return blocks


def assert_queue_linked(pool: BlockPool) -> None:
    """Forward links, back links and the counter agree: a broken O(1) unlink shows up here."""
    forward = list(pool.free_queue)
    backward = []
    node = pool.free_queue._tail.prev_free
    while node is not pool.free_queue._head:
        backward.append(node)
        node = node.prev_free
    assert forward == backward[::-1]
    assert len(forward) == pool.num_free_blocks


def test_fresh_pool_hands_out_blocks_in_id_order():
    pool = BlockPool(8, enable_caching=True)
    assert ids(pool.get_new_blocks(3)) == [0, 1, 2]
    assert ids(pool.get_new_blocks(2)) == [3, 4]
    assert pool.num_free_blocks == 3
    assert all(b.ref_cnt == 1 for b in pool.blocks[:5]) and all(b.ref_cnt == 0 for b in pool.blocks[5:])


def test_freed_blocks_are_reused_least_recently_freed_first():
    pool = BlockPool(4, enable_caching=True)
    a, b, c, d = pool.get_new_blocks(4)
    pool.free_blocks([c])
    pool.free_blocks([a, d])
    # Freed blocks join the tail: c (freed first) is handed out first, then a, then d.
    assert ids(pool.get_new_blocks(3)) == [c.block_id, a.block_id, d.block_id]
    assert pool.num_free_blocks == 0
    assert b.ref_cnt == 1


def test_asking_for_more_blocks_than_free_raises_and_takes_nothing():
    pool = BlockPool(4, enable_caching=True)
    pool.get_new_blocks(3)
    with pytest.raises(RuntimeError, match="asked for 2 blocks with 1 free"):
        pool.get_new_blocks(2)
    assert pool.num_free_blocks == 1
    assert ids(pool.get_new_blocks(1)) == [3]


def test_usage_is_the_fraction_of_blocks_not_free():
    pool = BlockPool(4, enable_caching=True)
    assert pool.usage == 0.0
    blocks = pool.get_new_blocks(3)
    assert pool.usage == pytest.approx(0.75)
    pool.free_blocks(blocks[:1])
    assert pool.usage == pytest.approx(0.5)
    pool.free_blocks(blocks[1:])
    assert pool.usage == 0.0


def test_shared_block_returns_to_the_pool_only_with_its_last_reference():
    pool = BlockPool(4, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.touch([block])                      # a second request shares it (a prefix hit on a used block)
    assert block.ref_cnt == 2 and pool.num_free_blocks == 3
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 3 and block not in list(pool.free_queue)
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.num_free_blocks == 4 and list(pool.free_queue)[-1] is block


def test_freeing_a_block_twice_is_an_error():
    pool = BlockPool(2, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.free_blocks([block])
    with pytest.raises(RuntimeError, match="freed twice"):
        pool.free_blocks([block])


def test_hit_on_a_free_cached_block_unlinks_it_from_the_middle_of_the_queue():
    pool = BlockPool(6, enable_caching=True)
    blocks = cached_and_freed(pool, 6)
    hit = pool.get_cached_block(h(3))
    assert hit is blocks[3]
    pool.touch([hit])
    assert hit.ref_cnt == 1 and hit.prev_free is None and hit.next_free is None
    assert ids(pool.free_queue) == [0, 1, 2, 4, 5]        # the others keep their eviction order
    assert_queue_linked(pool)
    # Two more hits, at the head and at the tail of the queue.
    pool.touch([pool.get_cached_block(h(0)), pool.get_cached_block(h(5))])
    assert ids(pool.free_queue) == [1, 2, 4]
    assert_queue_linked(pool)
    # A hit block is in use: new allocations can no longer evict it.
    assert sorted(ids(pool.get_new_blocks(3))) == [1, 2, 4]
    assert pool.get_cached_block(h(3)) is blocks[3]
    with pytest.raises(RuntimeError):
        pool.get_new_blocks(1)


def _hit_seconds(num_blocks: int, hits: int = 1000, repeats: int = 5) -> float:
    """Best time to take `hits` cached blocks from the middle of a free queue of num_blocks (and back)."""
    pool = BlockPool(num_blocks, enable_caching=True)
    blocks = cached_and_freed(pool, num_blocks)
    middle = blocks[num_blocks // 2 - hits // 2:][:hits]
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        pool.touch(middle)
        best = min(best, time.perf_counter() - start)
        pool.free_blocks(middle)
    return best


def test_hit_removal_cost_does_not_grow_with_the_free_queue():
    """A prefix hit unlinks its block through the block's own pointers; a search (deque.remove) would
    make 1000 hits in a 100x longer queue about 100x slower."""
    small, big = _hit_seconds(2_000), _hit_seconds(200_000)
    assert big < 10 * small, f"1000 hits: {small * 1e3:.2f} ms in 2k blocks, {big * 1e3:.2f} ms in 200k"


def test_touching_a_block_in_use_does_not_touch_the_free_queue():
    pool = BlockPool(3, enable_caching=True)
    block = pool.get_new_blocks(1)[0]
    pool.touch([block])
    assert pool.num_free_blocks == 2 and ids(pool.free_queue) == [1, 2]


def test_eviction_takes_the_lru_cached_block_and_drops_its_hash():
    pool = BlockPool(4, enable_caching=True)
    blocks = cached_and_freed(pool, 4)
    assert all(pool.get_cached_block(h(i)) is blocks[i] for i in range(4))
    taken = pool.get_new_blocks(2)
    assert ids(taken) == [0, 1]                            # freed first, evicted first
    assert all(b.block_hash is None for b in taken)
    assert pool.get_cached_block(h(0)) is None and pool.get_cached_block(h(1)) is None
    assert pool.get_cached_block(h(2)) is blocks[2] and pool.get_cached_block(h(3)) is blocks[3]
    assert set(pool.cached) == {h(2), h(3)}


def test_a_hash_is_cached_once_and_a_cached_block_keeps_its_first_hash():
    pool = BlockPool(4, enable_caching=True)
    first, dup = pool.get_new_blocks(2)
    pool.cache_block(first, h(7))
    pool.cache_block(dup, h(7))                 # two requests computed the same prefix in one step
    assert pool.get_cached_block(h(7)) is first and dup.block_hash is None
    pool.cache_block(first, h(8))
    assert first.block_hash == h(7) and pool.get_cached_block(h(8)) is None
    # The duplicate returns to the pool as a plain block; evicting it leaves the real entry alone.
    pool.free_blocks([dup])
    pool.get_new_blocks(3)
    assert pool.get_cached_block(h(7)) is first


def test_without_caching_a_freed_block_loses_its_hash_at_once():
    pool = BlockPool(2, enable_caching=False)
    block = pool.get_new_blocks(1)[0]
    pool.cache_block(block, h(1))
    pool.free_blocks([block])
    assert block.block_hash is None and pool.get_cached_block(h(1)) is None


def test_reset_prefix_cache_is_refused_while_any_block_is_in_use():
    pool = BlockPool(4, enable_caching=True)
    cached_and_freed(pool, 3)
    held = pool.get_new_blocks(1)               # block 3: the only never-cached free block
    assert ids(held) == [3]
    assert pool.reset_prefix_cache() is False
    assert set(pool.cached) == {h(0), h(1), h(2)}, "a refused reset must not drop anything"
    pool.free_blocks(held)
    assert pool.reset_prefix_cache() is True
    assert pool.cached == {} and all(b.block_hash is None for b in pool.blocks)
    assert pool.num_free_blocks == 4


def test_pool_must_have_blocks():
    with pytest.raises(ValueError, match="num_blocks must be positive"):
        BlockPool(0, enable_caching=True)
