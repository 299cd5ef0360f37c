"""Which items' encoder outputs the workers hold, and which they are to compute this step.

The core decides and the workers follow (vLLM V1's split): an entry is an item's output, keyed by its content
hash, sized in placeholder tokens. Requests part-way through an item hold a reference to it; an entry nobody
references stays cached, least recently used first out, so a repeated image is encoded once. Evicted hashes
are sent to the workers with the next step, before its new items.
"""
from __future__ import annotations

from collections import OrderedDict

from pagedserve.ipc.messages import EncoderInput, MultiModalFeature


class EncoderCacheManager:
    def __init__(self, cache_size: int) -> None:
        self.cache_size = cache_size
        self.num_used = 0
        self.sizes: dict[str, int] = {}               # every entry the workers hold (or compute this step)
        self.refs: dict[str, set[str]] = {}           # entry -> requests still reading it
        self.idle: OrderedDict[str, None] = OrderedDict()   # unreferenced entries, least recently used first
        self.freed: list[str] = []                    # evicted since the last step: the workers drop them
        self.hits = self.queries = 0

    def has(self, mm_hash: str) -> bool:
        return mm_hash in self.sizes

    def can_fit(self, size: int, keep: set[str] = frozenset()) -> bool:
        """Room for `size` tokens once every unreferenced entry but those in `keep` is evicted."""
        idle = sum(self.sizes[h] for h in self.idle if h not in keep)
        return self.cache_size - self.num_used + idle >= size

    def acquire(self, mm_hash: str, request_id: str) -> None:
        self.refs.setdefault(mm_hash, set()).add(request_id)
        self.idle.pop(mm_hash, None)

    def add(self, mm_hash: str, size: int, request_id: str) -> None:
        """A new entry (its output computed this step); the caller checked can_fit."""
        while self.cache_size - self.num_used < size:
            victim, _ = self.idle.popitem(last=False)
            self._drop(victim)
            self.freed.append(victim)
        self.sizes[mm_hash] = size
        self.num_used += size
        self.acquire(mm_hash, request_id)

    def release(self, mm_hash: str, request_id: str) -> None:
        holders = self.refs.get(mm_hash)
        if holders is None or request_id not in holders:
            return
        holders.discard(request_id)
        if not holders:
            del self.refs[mm_hash]
            self.idle[mm_hash] = None

    def forget(self, mm_hash: str) -> None:
        """An entry whose output was never computed (its step was taken back): gone, with nothing to tell."""
        if mm_hash in self.sizes:
            self.refs.pop(mm_hash, None)
            self.idle.pop(mm_hash, None)
            self._drop(mm_hash)

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def _drop(self, mm_hash: str) -> None:
        self.num_used -= self.sizes.pop(mm_hash)


def encoder_input(item: MultiModalFeature) -> EncoderInput:
    return EncoderInput(mm_hash=item.mm_hash, modality=item.modality, data=item.data or {})
