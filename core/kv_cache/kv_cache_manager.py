"""Per-request block tables over the block pool, with prefix caching."""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve.core.kv_cache.block_pool import BlockPool, KVCacheBlock
from pagedserve.core.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass
class PrefixCacheStats:
    queries: int = 0      # prompt tokens looked up
    hits: int = 0         # of those, tokens found in the cache


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool) -> None:
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_cached_blocks: dict[str, int] = {}
        self.prefix_stats = PrefixCacheStats()

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """The longest cached prefix of the request, in whole blocks, leaving >= 1 token to compute
        (the last token must run through the model to produce logits)."""
        # Prompt logprobs need every prompt position's logits, so such a request computes its whole prompt.
        if not self.enable_caching or request.sampling_params.prompt_logprobs is not None:
            return [], 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        self.prefix_stats.queries += request.num_tokens
        self.prefix_stats.hits += len(hits) * self.block_size
        return hits, len(hits) * self.block_size

    def cut_hit(self, hits: list[KVCacheBlock], num_tokens: int) -> tuple[list[KVCacheBlock], int]:
        """A prefix hit kept only up to num_tokens, rounded down to whole blocks (the scheduler's rules may
        forbid a hit from ending where it would: inside a Gemma 3 image)."""
        keep = min(len(hits), num_tokens // self.block_size)
        self.prefix_stats.hits -= (len(hits) - keep) * self.block_size
        return hits[:keep], keep * self.block_size

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: Sequence[KVCacheBlock] = (),
                       num_new_computed_tokens: int = 0, num_lookahead_tokens: int = 0,
                       cache: bool = True) -> list[KVCacheBlock] | None:
        """Make room for num_new_tokens more tokens after the computed ones; None if the pool is short.

        new_computed_blocks are prefix hits (for a request being scheduled from the waiting queue).
        num_lookahead_tokens: slots past those a speculative draft model writes its proposals to; they hold
        no token of the request, so they never make a block count as computed for the prefix cache.
        cache=False: the new blocks join the prefix cache only with cache_blocks (a connector fills them first).
        """
        blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed = request.num_computed_tokens + num_new_computed_tokens
        num_required = cdiv(num_computed + num_new_tokens + num_lookahead_tokens, self.block_size)
        num_new_blocks = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hit blocks with no other user sit in the free queue: taking them uses up free capacity.
        num_hit_free = sum(1 for b in new_computed_blocks if b.ref_cnt == 0)
        if num_new_blocks + num_hit_free > self.pool.num_free_blocks:
            if not blocks:
                del self.req_to_blocks[request.request_id]
            return None
        self.pool.touch(new_computed_blocks)
        blocks.extend(new_computed_blocks)
        new_blocks = self.pool.get_new_blocks(num_new_blocks)
        blocks.extend(new_blocks)
        if self.enable_caching and cache:
            self._cache_full_blocks(request, blocks, num_computed + num_new_tokens)
        return new_blocks

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """The request's full blocks up to num_tokens join the prefix cache (their KV is there now)."""
        if self.enable_caching:
            self._cache_full_blocks(request, self.req_to_blocks.get(request.request_id, []), num_tokens)

    def holds_blocks(self, request_id: str) -> bool:
        return bool(self.req_to_blocks.get(request_id))

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock], num_tokens: int) -> None:
        # Blocks are registered when scheduled, before they are computed: a later request in the
        # same step may hit them, which is safe because every layer writes this step's K/V for
        # all tokens before any attention reads the cache.
        start = self._num_cached_blocks.get(request.request_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, end):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        self._num_cached_blocks[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self._num_cached_blocks.pop(request.request_id, None)
        # Tail blocks first, so they are evicted before the shared prefix blocks.
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, ())]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()
