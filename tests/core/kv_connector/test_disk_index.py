"""The core's view of the disk tier (DiskIndex: eviction order within the size, a restart's scan) and the
connector's settings, without an engine."""
from __future__ import annotations

import os
import time

import pytest

from pagedserve.common.kv_transfer.config import parse_kv_transfer
from pagedserve.common.kv_transfer.layout import STALE_TMP_S, block_path, parse_block_name
from pagedserve.core.kv_connector.disk_index import DiskIndex


def _key(i: int) -> bytes:
    return bytes([i]) * 16


def _write(ns: str, i: int, depth: int, size: int = 100) -> str:
    path = block_path(ns, _key(i), depth)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(b"x" * size)
    return path


def test_block_names_round_trip():
    path = block_path("/t", _key(7), 3)
    assert parse_block_name(os.path.basename(path)) == (_key(7), 3)
    assert parse_block_name(os.path.basename(path) + ".123.140.tmp") is None
    assert parse_block_name("notes.txt") is None


def test_eviction_takes_a_chains_leaves_first(tmp_path):
    ns = str(tmp_path)
    index = DiskIndex(ns, capacity_bytes=300)
    chain = [_key(i) for i in range(3)]
    paths = [_write(ns, i, depth=i) for i in range(3)]
    for depth, key in enumerate(chain):         # saved root first, as a prefill saves them
        index.add(key, depth, 100)
    index.touch_chain(chain)
    other = _write(ns, 9, depth=0)
    index.add(_key(9), 0, 100)                   # a fourth block: one must go
    index.evict()
    assert not os.path.exists(paths[2])          # the chain's leaf, not its root
    assert all(os.path.exists(p) for p in (paths[0], paths[1], other))
    assert index.total_bytes == 300 and _key(2) not in index and chain[0] in index


def test_a_hit_keeps_its_chain_over_older_blocks(tmp_path):
    ns = str(tmp_path)
    index = DiskIndex(ns, capacity_bytes=300)
    for i in range(3):
        _write(ns, i, depth=0)
        index.add(_key(i), 0, 100)
    index.touch_chain([_key(0)])                 # block 0 was hit: block 1 is now the least recent
    _write(ns, 5, depth=0)
    index.add(_key(5), 0, 100)
    index.evict()
    assert _key(1) not in index and _key(0) in index


def test_restart_scans_blocks_and_drops_stale_temporary_files(tmp_path):
    ns = str(tmp_path)
    now = time.time()
    for i, depth in enumerate((0, 1, 2)):
        os.utime(_write(ns, i, depth), (now, now))     # one moment: the order is then by depth alone
    stale = block_path(ns, _key(1), 1) + ".77.1.tmp"
    fresh = block_path(ns, _key(2), 2) + ".78.1.tmp"
    for tmp in (stale, fresh):
        with open(tmp, "wb") as f:
            f.write(b"half")
    old = time.time() - STALE_TMP_S - 5
    os.utime(stale, (old, old))
    index = DiskIndex(ns, capacity_bytes=200)     # room for two of the three: the deepest goes
    assert len(index) == 2 and _key(2) not in index
    assert not os.path.exists(stale) and os.path.exists(fresh)    # another writer may still own the fresh one


@pytest.mark.parametrize("transfer, message", [
    ({"kv_connector": "NixlConnector"}, "kv_connector must be one of"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "kv_both", "extra": 1}, "unknown key"),
    ({"kv_connector": "OffloadingConnector", "kv_role": "prefill"}, "kv_role must be one of"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"path": "."}}, "size_gib"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"path": ".", "size_gib": -1}},
     "above 0"),
    ({"kv_connector": "OffloadingConnector", "kv_connector_extra_config": {"backend": "lmcache"}},
     "backend must be one of"),
])
def test_kv_transfer_config_is_checked(transfer, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer(transfer, None, None, None)


def test_offloading_flags_are_shorthand_for_the_connector(tmp_path):
    kv = parse_kv_transfer(None, "disk", 2, str(tmp_path))
    assert (kv.kv_connector, kv.kv_role, kv.path, kv.size_bytes) == ("OffloadingConnector", "kv_both",
                                                                     str(tmp_path), 2 << 30)
    with pytest.raises(ValueError, match="not both"):
        parse_kv_transfer({"kv_connector": "OffloadingConnector"}, "disk", 2, str(tmp_path))
    with pytest.raises(ValueError, match="--kv-offloading-backend"):
        parse_kv_transfer(None, None, 2, None)
    with pytest.raises(ValueError, match="--kv-offloading-size"):
        parse_kv_transfer(None, "disk", None, str(tmp_path))


def test_shared_storage_connector_takes_vllm_s_keys(tmp_path):
    kv = parse_kv_transfer({"kv_connector": "SharedStorageConnector", "kv_role": "kv_consumer",
                            "kv_connector_extra_config": {"shared_storage_path": str(tmp_path)}}, None, None, None)
    assert (kv.kv_connector, kv.kv_role, kv.path, kv.size_bytes, kv.shared) == (
        "SharedStorageConnector", "kv_consumer", str(tmp_path), None, True)
    assert not kv.can_save and kv.can_load
    sized = parse_kv_transfer({"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": {
        "shared_storage_path": str(tmp_path), "size_gib": 1}}, None, None, None)
    assert sized.size_bytes == 1 << 30 and sized.kv_role == "kv_both"


@pytest.mark.parametrize("extra, message", [
    ({}, r"kv_connector_extra_config\.shared_storage_path: the disk tier needs a folder"),
    ({"shared_storage_path": "/nonexistent/kv"}, r"shared_storage_path: /nonexistent/kv does not exist"),
    ({"path": "."}, r"unknown key\(s\) path \(allowed: shared_storage_path, size_gib\)"),
    ({"shared_storage_path": ".", "size_gib": 0}, r"size_gib must be a size in GiB above 0"),
])
def test_shared_storage_connector_refuses_bad_settings(extra, message):
    with pytest.raises(ValueError, match=message):
        parse_kv_transfer({"kv_connector": "SharedStorageConnector", "kv_connector_extra_config": extra},
                          None, None, None)


def test_shared_storage_without_a_size_never_evicts(tmp_path):
    ns = str(tmp_path / "ns")
    index = DiskIndex(ns, capacity_bytes=None)
    for i in range(5):
        index.add(bytes([i]) * 16, i, 1 << 20)
    index.evict()
    assert len(index) == 5
