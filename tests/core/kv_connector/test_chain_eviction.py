"""DiskIndex evicts whole prefix chains, leaves first: a block whose parent is gone can never be hit, so it
never outlives the parent (docs/kv_tiers.md, eviction). On the index and real block files, without an engine."""
from __future__ import annotations

import os
import time

import torch

from pagedserve.common.kv_transfer.layout import block_path
from pagedserve.core.kv_connector.disk_index import DiskIndex
from pagedserve.executor.kv_connector.disk_store import BlockFormat, write_block


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def _file(ns: str, i: int, depth: int, parent: int | None = None) -> str:
    path = block_path(ns, _key(i), depth)
    fmt = BlockFormat("ns", "torch.float32", ((2, 1, 4, 4),), 128)
    write_block(path, fmt, _key(i), depth, [torch.zeros(2, 1, 4, 4)], b"" if parent is None else _key(parent))
    return path


def test_evicting_a_parent_takes_its_subtree_first(tmp_path):
    """0 <- 1 <- 2 and 1 <- 3 (two conversations sharing blocks 0-1), then an unrelated block 9. Block 0 is
    the least recent (saved first, never touched since): all four of its chain go, deepest first, not 0 alone."""
    ns = str(tmp_path)
    index = DiskIndex(ns, capacity_bytes=None)
    size = os.path.getsize(_file(ns, 0, 0))
    for i, depth, parent in ((0, 0, None), (1, 1, 0), (2, 2, 1), (3, 2, 1), (9, 0, None)):
        _file(ns, i, depth, parent)
        index.add(_key(i), depth, size, b"" if parent is None else _key(parent))
    order = []
    index._remove = lambda key, remove=index._remove: (order.append(key), remove(key))[1]
    index.capacity = 4 * size                    # one block too many
    index.evict()
    assert order[-1] == _key(0) and order.index(_key(1)) > max(order.index(_key(2)), order.index(_key(3)))
    assert set(order) == {_key(i) for i in range(4)} and len(index) == 1 and _key(9) in index
    assert index.evicted == 4 and index.total_bytes == size
    assert not any(os.path.exists(block_path(ns, _key(i), d)) for i, d in ((0, 0), (1, 1), (2, 2), (3, 2)))


def test_touching_a_chain_learns_its_links_and_keeps_leaves_first(tmp_path):
    ns = str(tmp_path)
    index = DiskIndex(ns, capacity_bytes=None)
    size = os.path.getsize(_file(ns, 0, 0))
    for i in range(3):                           # added without parents (a file from before the field)
        _file(ns, i, i, i - 1 if i else None)
        index.add(_key(i), i, size)
    _file(ns, 9, 0)
    index.add(_key(9), 0, size)
    index.touch_chain([_key(0), _key(1), _key(2)])   # a hit: the chain is the most recent, its root last
    assert index._parent == {_key(1): _key(0), _key(2): _key(1)}
    index.capacity = 2 * size
    index.evict()                                # 9 is the least recent, then the chain's leaf, not its root
    assert list(index._entries) == [_key(1), _key(0)]
    _file(ns, 2, 2, 1)
    index.add(_key(2), 2, size, _key(1))         # saved again, and 0 touched alone: 1 is now the least recent
    index.touch_chain([_key(0)])
    index.evict()                                # 1 goes with its child 2, never before it
    assert list(index._entries) == [_key(0)] and not os.path.exists(block_path(ns, _key(2), 2))


def test_a_restart_reads_each_block_s_parent_and_leaves_no_orphan(tmp_path):
    """A chain 0-5 whose first three blocks are an hour older than the rest: the scan's order (oldest minute
    first) puts depth 2 first, and with it go 3-5; blocks 0 and 1 stay, every survivor reachable."""
    ns = str(tmp_path)
    paths = [_file(ns, i, i, i - 1 if i else None) for i in range(6)]
    old = time.time() - 3600
    for p in paths[:3]:
        os.utime(p, (old, old))
    size = os.path.getsize(paths[0])
    index = DiskIndex(ns, capacity_bytes=int(4.5 * size))
    assert [k for k in index._entries] == [_key(1), _key(0)]
    assert [os.path.exists(p) for p in paths] == [True, True, False, False, False, False]
    assert index.evicted == 4
