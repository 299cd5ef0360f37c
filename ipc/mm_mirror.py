"""The processed multimodal items an engine core holds for one client, kept on both sides of the socket.

vLLM V1's sender/receiver processor cache: a client that sent an item's processed tensors once sends only its
hash the next time, and the core takes the tensors from its copy. No message says what the core holds: both
ends run the same least-recently-used policy over the same sequence of items (the client when it sends a
request, the core when it receives it, in the socket's order), within the same byte budget
(`--mm-processor-cache-gb`), so their contents stay the same. An item larger than the budget is never held,
on either side. A core that misses an item anyway (a client it had forgotten) refuses that request, naming the
item, and the client starts its mirror over.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Optional

import msgspec

from pagedserve.ipc.messages import MultiModalFeature, TensorData

GIB = 1 << 30
MISSING_ITEM = "the item's processed data is not held by the engine core (--mm-processor-cache-gb)"


def item_bytes(data: dict[str, TensorData]) -> int:
    """What an item counts against the budget: its tensors' bytes (the same number at both ends)."""
    return sum(len(t.data) for t in data.values())


class ItemMirror:
    """The least-recently-used set of item hashes within `capacity` bytes; `keep_data`: the core's side, which
    also holds each item's tensors."""

    def __init__(self, capacity: int, keep_data: bool) -> None:
        self.capacity = capacity
        self.keep_data = keep_data
        self.used = 0
        self._sizes: OrderedDict[str, int] = OrderedDict()
        self._data: dict[str, dict[str, TensorData]] = {}

    @classmethod
    def of_gb(cls, gib: float, keep_data: bool) -> Optional["ItemMirror"]:
        """None for a budget of 0: the cache is off, and every item travels whole."""
        return cls(int(gib * GIB), keep_data) if gib > 0 else None

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._sizes

    def strip(self, features: list[MultiModalFeature]) -> list[MultiModalFeature]:
        """The client's side: each item the core already holds goes without its tensors."""
        out = []
        for item in features:
            if item.data is not None and self._touch(item.mm_hash):
                item = msgspec.structs.replace(item, data=None)
            elif item.data is not None:
                self._insert(item.mm_hash, item.data)
            out.append(item)
        return out

    def fill(self, features: list[MultiModalFeature]) -> tuple[list[MultiModalFeature], Optional[int]]:
        """The core's side: each item sent without its tensors takes the held ones. Also returns the index of
        the first item sent bare that it does not hold (None if none): the request is refused; the others
        are taken in, as the client took them in."""
        out, missing = [], None
        for i, item in enumerate(features):
            if item.data is None:
                if self._touch(item.mm_hash):
                    item = msgspec.structs.replace(item, data=self._data[item.mm_hash])
                elif missing is None:
                    missing = i
            else:
                self._insert(item.mm_hash, item.data)
            out.append(item)
        return out, missing

    def clear(self) -> None:
        self._sizes.clear()
        self._data.clear()
        self.used = 0

    def _touch(self, mm_hash: str) -> bool:
        if mm_hash not in self._sizes:
            return False
        self._sizes.move_to_end(mm_hash)
        return True

    def _insert(self, mm_hash: str, data: dict[str, TensorData]) -> None:
        if mm_hash in self._sizes:                 # held already: the newer copy, the same bytes
            self._drop(mm_hash)
        size = item_bytes(data)
        if size > self.capacity:
            return
        while self.used + size > self.capacity:
            self._drop(next(iter(self._sizes)))
        self._sizes[mm_hash] = size
        self.used += size
        if self.keep_data:
            self._data[mm_hash] = data

    def _drop(self, mm_hash: str) -> None:
        self.used -= self._sizes.pop(mm_hash)
        self._data.pop(mm_hash, None)
