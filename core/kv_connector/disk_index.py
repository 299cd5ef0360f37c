"""Which blocks the disk tier holds, in eviction order, within its size. The core's view of the folder: it
lists the files at start, learns of new ones from the workers' reports, and deletes what it evicts; the
workers write and read the files (executor/kv_connector/disk_store.py)."""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence

from pagedserve.common.kv_transfer.layout import (STALE_TMP_S, TMP_SUFFIX, block_path, parse_block_name,
                                                   read_parent)

logger = logging.getLogger(__name__)


class DiskIndex:
    """key -> (bytes, depth), least recently used first, and each block's place in its prefix chain.

    A chain is only of use from its first block, so every touch of a chain puts its blocks back in reverse
    order (the first block is the most recent) and eviction takes leaves first. When the least recent block
    still has children (a restart's order, which knows only file times), the whole subtree under it goes,
    deepest first, with it: a child whose parent is gone can never be reached, so keeping it wastes space."""

    def __init__(self, namespace_dir: str, capacity_bytes: int | None) -> None:
        self.dir = namespace_dir
        self.capacity = capacity_bytes
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
        self._parent: dict[bytes, bytes] = {}          # key -> its parent's key (known links only)
        self._children: dict[bytes, set[bytes]] = {}   # key -> the keys whose parent it is, in the index
        self.total_bytes = 0
        self.evicted = 0                 # blocks evicted since start (vllm:kv_offload_block_eviction)
        self._warned = False
        os.makedirs(namespace_dir, exist_ok=True)
        self._scan()
        self.evict()
        logger.info("KV disk tier %s: %d blocks, %.1f MiB of %s", namespace_dir, len(self._entries),
                    self.total_bytes / (1 << 20),
                    "no bound" if capacity_bytes is None else f"{capacity_bytes / (1 << 20):.1f} MiB")

    def _scan(self) -> None:
        """The blocks already there (a restart), oldest minute first and deepest first within it, with each
        one's parent from its header. Stale temporary files of a crashed writer go."""
        found = []
        now = time.time()
        for sub in os.scandir(self.dir):
            if not sub.is_dir(follow_symlinks=False):
                continue
            for entry in os.scandir(sub.path):
                try:
                    st = entry.stat(follow_symlinks=False)
                    parsed = parse_block_name(entry.name)
                    if parsed is None:
                        if entry.name.endswith(TMP_SUFFIX) and now - st.st_mtime > STALE_TMP_S:
                            os.unlink(entry.path)
                        continue
                except OSError:          # gone meanwhile (another engine on this folder evicted it)
                    continue
                key, depth = parsed
                found.append((int(st.st_mtime) // 60, -depth, key, st.st_size, depth, read_parent(entry.path)))
        found.sort()
        for _, _, key, size, depth, parent in found:
            self._entries[key] = (size, depth)
            self.total_bytes += size
        for _, _, key, _, _, parent in found:
            if parent:
                self._link(key, parent)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: bytes, depth: int, nbytes: int, parent: bytes = b"") -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old[0]
        self._entries[key] = (nbytes, depth)
        self.total_bytes += nbytes
        if parent:
            self._link(key, parent)

    def _link(self, key: bytes, parent: bytes) -> None:
        if self._parent.get(key) == parent:
            return
        self._unlink(key)
        self._parent[key] = parent
        self._children.setdefault(parent, set()).add(key)

    def _unlink(self, key: bytes) -> None:
        parent = self._parent.pop(key, None)
        if parent is not None and (siblings := self._children.get(parent)) is not None:
            siblings.discard(key)
            if not siblings:
                del self._children[parent]

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """A chain (first block first) was used: its blocks become the most recent, the first one last."""
        for i in range(len(keys) - 1, -1, -1):
            key = keys[i]
            if key in self._entries:
                self._entries.move_to_end(key)
                if i:
                    self._link(key, keys[i - 1])

    def discard(self, key: bytes) -> None:
        """A block the workers found bad (and deleted). Its children stay: the request that found it
        computes the block again, and saving it mends the chain."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old[0]
            self._unlink(key)

    def evict(self) -> None:
        if self.capacity is None:        # shared storage without size_gib: vLLM's never evicts either
            return
        while self.total_bytes > self.capacity and self._entries:
            for key in self._subtree_leaves_first(next(iter(self._entries))):
                self._remove(key)

    def _subtree_leaves_first(self, root: bytes) -> list[bytes]:
        """root and every block below it in the index, each after all of its children."""
        order, stack = [], [root]
        while stack:
            key = stack.pop()
            order.append(key)
            stack.extend(k for k in self._children.get(key, ()) if k in self._entries)
        return order[::-1]

    def _remove(self, key: bytes) -> None:
        size, depth = self._entries.pop(key)
        self.total_bytes -= size
        self.evicted += 1
        self._unlink(key)
        self._children.pop(key, None)
        try:
            os.unlink(block_path(self.dir, key, depth))
        except FileNotFoundError:
            pass                         # another engine on this folder evicted it first
        except OSError as exc:
            if not self._warned:
                self._warned = True
                logger.warning("KV disk tier: cannot delete evicted blocks in %s (%s); the folder may grow "
                               "past the tier's size", self.dir, exc)
