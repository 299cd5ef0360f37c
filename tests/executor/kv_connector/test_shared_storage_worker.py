"""The SharedStorageConnector's worker side on real caches (docs/kv_tiers.md): a producer's blocks are on disk,
whole and checked, when the step's wait_for_save returns (the prefill's answer leaves after that, so the decode
instance the proxy asks next finds them: over HTTP that race is too quick to lose, so it is asserted here),
and a consumer loads them into its own cache bit for bit."""
from __future__ import annotations

import os

import torch

from pagedserve.common.kv_transfer.config import KVTransferConfig
from pagedserve.common.kv_transfer.layout import block_path
from pagedserve.executor.kv_connector.offloading import make_worker_connector
from pagedserve.ipc.messages import KVBlockTransfer, KVConnectorMetadata

NUM_BLOCKS, KV_HEADS, BS, HEAD_DIM, LAYERS = 80, 2, 16, 16, 2
SAVED = 64                       # one step's blocks: the writer thread could not have written them all yet


def _config(path: str, role: str) -> KVTransferConfig:
    return KVTransferConfig("SharedStorageConnector", role, "disk", path, None, namespace="ns")


def _caches(seed: int | None) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed or 0)
    shape = (2, NUM_BLOCKS, KV_HEADS, BS, HEAD_DIM)
    return [torch.randn(shape, generator=gen) if seed is not None else torch.zeros(shape) for _ in range(LAYERS)]


def test_a_producer_s_step_is_on_disk_when_it_ends_and_a_consumer_loads_it(tmp_path):
    path = str(tmp_path)
    keys = [i.to_bytes(2, "little") * 8 for i in range(SAVED)]
    producer, src = make_worker_connector(_config(path, "kv_producer")), _caches(seed=1)
    producer.register_kv_caches(src)
    producer.bind_connector_metadata(KVConnectorMetadata(saves=[KVBlockTransfer(i, k, i) for i, k in enumerate(keys)]))
    for layer, cache in enumerate(src):
        producer.save_kv_layer(layer, cache)
    producer.wait_for_save()
    on_disk = [os.path.exists(block_path(os.path.join(path, "ns"), k, i)) for i, k in enumerate(keys)]
    assert all(on_disk), f"{on_disk.count(False)} of {SAVED} blocks not on disk when the step ended"
    report = producer.get_finished([])
    assert len(report.saved) == SAVED and not report.failed_saves and report.store_time_s > 0
    producer.close()

    consumer, dst = make_worker_connector(_config(path, "kv_consumer")), _caches(seed=None)
    consumer.register_kv_caches(dst)
    # Into other block ids (the decode instance's pool is its own): block i of the chain goes to block 79 - i.
    loads = {"r": [KVBlockTransfer(NUM_BLOCKS - 1 - i, k, i) for i, k in enumerate(keys)]}
    consumer.bind_connector_metadata(KVConnectorMetadata(loads=loads))
    consumer.start_load_kv()
    report = consumer.get_finished([])
    assert report.finished_recving == {"r": SAVED} and report.invalid_keys == []
    assert report.load_bytes == \
        SAVED * LAYERS * 2 * KV_HEADS * BS * HEAD_DIM * 4
    for a, b in zip(src, dst):
        assert torch.equal(b[:, NUM_BLOCKS - SAVED:].flip(1), a[:, :SAVED])
        assert not b[:, :NUM_BLOCKS - SAVED].any()          # nothing else written
    assert consumer._writer is None                           # a consumer never saves
