"""Which blocks the disk tier holds, in eviction order, within its size. The core's view of the folder: it
lists the files at start, learns of new ones from the workers' reports, and deletes what it evicts; the
workers write and read the files (executor/kv_connector/disk_store.py)."""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Sequence

from pagedserve.common.kv_transfer.layout import STALE_TMP_S, TMP_SUFFIX, block_path, parse_block_name

logger = logging.getLogger(__name__)


class DiskIndex:
    """key -> (bytes, depth), least recently used first. A prefix chain is only of use from its first
    block, so every touch of a chain puts its blocks back in reverse order: the first block is the most
    recent, and eviction takes a chain's deepest blocks (its leaves) first."""

    def __init__(self, namespace_dir: str, capacity_bytes: int | None) -> None:
        self.dir = namespace_dir
        self.capacity = capacity_bytes
        self._entries: OrderedDict[bytes, tuple[int, int]] = OrderedDict()
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
        """The blocks already there (a restart), oldest minute first and deepest first within it: a chain
        written in one go then loses its leaves before its root. Stale temporary files of a crashed writer go."""
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
                found.append((int(st.st_mtime) // 60, -depth, key, st.st_size, depth))
        found.sort()
        for _, _, key, size, depth in found:
            self._entries[key] = (size, depth)
            self.total_bytes += size

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def add(self, key: bytes, depth: int, nbytes: int) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old[0]
        self._entries[key] = (nbytes, depth)
        self.total_bytes += nbytes

    def touch_chain(self, keys: Sequence[bytes]) -> None:
        """A chain (first block first) was used: its blocks become the most recent, the first one last."""
        for key in reversed(keys):
            if key in self._entries:
                self._entries.move_to_end(key)

    def discard(self, key: bytes) -> None:
        """A block the workers found bad (and deleted)."""
        old = self._entries.pop(key, None)
        if old is not None:
            self.total_bytes -= old[0]

    def evict(self) -> None:
        if self.capacity is None:        # shared storage without size_gib: vLLM's never evicts either
            return
        while self.total_bytes > self.capacity and self._entries:
            key, (size, depth) = self._entries.popitem(last=False)
            self.total_bytes -= size
            self.evicted += 1
            try:
                os.unlink(block_path(self.dir, key, depth))
            except FileNotFoundError:
                pass                     # another engine on this folder evicted it first
            except OSError as exc:
                if not self._warned:
                    self._warned = True
                    logger.warning("KV disk tier: cannot delete evicted blocks in %s (%s); the folder may grow "
                                   "past the tier's size", self.dir, exc)
