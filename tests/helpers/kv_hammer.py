"""One process of the two-writers test (tests/executor/kv_connector/test_disk_tier_faults.py): a real
BlockWriter and read_block on a shared folder, hammering the same keys as its twin, deleting some files as
another engine's eviction would, and verifying every read byte for byte. Prints its counts as JSON.

    python -m pagedserve.tests.helpers.kv_hammer FOLDER SEED ROUNDS
"""
from __future__ import annotations

import json
import os
import random
import sys

import torch

from pagedserve.common.kv_transfer.layout import CorruptBlock, block_path
from pagedserve.executor.kv_connector.disk_store import BlockFormat, BlockWriter, SaveBatch, read_block

SHAPE = (2, 2, 16, 16)                   # [K/V, kv_heads, block_size, head_dim]
NUM_CACHES = 2
FMT = BlockFormat("hammer", str(torch.float32), (SHAPE,) * NUM_CACHES, 4 * NUM_CACHES * 2 * 2 * 16 * 16)
KEYS = [bytes([i]) * 16 for i in range(24)]


def block_content(key: bytes) -> list[torch.Tensor]:
    """Each cache's block for a key: the same in every process (the same tokens give the same KV)."""
    gen = torch.Generator().manual_seed(int.from_bytes(key[:8], "little"))
    return [torch.randn(SHAPE, generator=gen) for _ in range(NUM_CACHES)]


def expected_payload(key: bytes) -> bytes:
    return b"".join(t.numpy().tobytes() for t in block_content(key))


def main(folder: str, seed: int, rounds: int) -> dict:
    rng = random.Random(seed)
    writer = BlockWriter(FMT, max_pending_bytes=1 << 30)
    want = {k: expected_payload(k) for k in KEYS}
    counts = {"reads_ok": 0, "misses": 0, "corrupt": 0, "mismatch": 0, "saved": 0}
    for _ in range(rounds):
        keys = rng.sample(KEYS, 8)
        gathered = [torch.stack([block_content(k)[c] for k in keys], dim=1) for c in range(NUM_CACHES)]
        writer.submit(SaveBatch([(block_path(folder, k, 0), k, 0, b"") for k in keys], gathered,
                                nbytes=len(keys) * FMT.nbytes))
        for key in KEYS:                    # while this writer's thread and the twin write the same files
            try:
                payload = read_block(block_path(folder, key, 0), FMT, key, 0)
            except FileNotFoundError:
                counts["misses"] += 1
                continue
            except CorruptBlock:
                counts["corrupt"] += 1
                continue
            counts["reads_ok" if bytes(payload) == want[key] else "mismatch"] += 1
        victim = block_path(folder, rng.choice(KEYS), 0)
        try:                                # the twin's eviction, as DiskIndex.evict does it
            os.unlink(victim)
        except FileNotFoundError:
            pass
        counts["saved"] += len(writer.take_results().saved)
    writer.close(60)
    counts["saved"] += len(writer.take_results().saved)
    return counts


if __name__ == "__main__":
    torch.set_num_threads(1)
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
