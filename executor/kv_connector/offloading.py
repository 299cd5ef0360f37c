"""The OffloadingConnector's worker side for the disk tier: loads blocks into the cache before the step, copies
the step's finished blocks out after it and hands them to the writer thread."""
from __future__ import annotations

import logging
import math
import os
import time

import torch

from pagedserve.common.kv_transfer.config import KVTransferConfig
from pagedserve.common.kv_transfer.layout import CorruptBlock, block_path
from pagedserve.executor.kv_connector.base import KVConnectorWorker
from pagedserve.executor.kv_connector.disk_store import BlockFormat, BlockWriter, SaveBatch, read_block
from pagedserve.ipc.messages import KVBlockTransfer, KVConnectorOutput

logger = logging.getLogger(__name__)

# Bytes of blocks copied out and waiting for the writer; past it a step's saves are dropped, never waited for.
MAX_PENDING_BYTES = 512 << 20
SHUTDOWN_FLUSH_S = 30.0


class DiskOffloadingWorker(KVConnectorWorker):
    def __init__(self, config: KVTransferConfig) -> None:
        self.config = config
        self.dir = config.namespace_dir
        self._caches: list[torch.Tensor] = []
        self._fmt: BlockFormat | None = None
        self._writer: BlockWriter | None = None
        self._gathered: list[torch.Tensor] = []
        self._save_ids: torch.Tensor | None = None          # this step's block ids to save, on the cache's device
        self._finished_loads: dict[str, int] = {}
        self._invalid: list[bytes] = []
        self._load_bytes = 0
        self._load_time_s = 0.0
        self._read_warned = False

    def register_kv_caches(self, kv_caches: list[torch.Tensor]) -> None:
        """Every cache the runner holds, in a fixed order (the model's layers, then a draft model's): a block
        file holds the block of each."""
        self._caches = kv_caches
        if not kv_caches:
            return
        shapes = tuple((2, *c.shape[2:]) for c in kv_caches)
        nbytes = sum(math.prod(s) for s in shapes) * kv_caches[0].element_size()
        self._fmt = BlockFormat(self.config.namespace, str(kv_caches[0].dtype), shapes, nbytes)
        if self._writer is None and self.config.can_save:
            self._writer = BlockWriter(self._fmt, MAX_PENDING_BYTES)

    # ---------------------------------------------------------------- loads

    def start_load_kv(self) -> None:
        """Synchronous in this slice: every load of the step is read, checked and copied before the forward."""
        meta = self._metadata
        if meta is None or not meta.loads or self._fmt is None:
            return
        t0 = time.perf_counter()
        for rid, blocks in meta.loads.items():
            self._finished_loads[rid] = n = self._load_chain(blocks)
            self._load_bytes += n * self._fmt.nbytes
        self._load_time_s += time.perf_counter() - t0

    def _load_chain(self, blocks: list[KVBlockTransfer]) -> int:
        """Blocks loaded, in order, up to the first that fails (the rest of the chain is computed instead)."""
        for n, block in enumerate(blocks):
            if self._writer is not None and (parts := self._writer.unwritten(block.key)) is not None:
                self._copy_parts(parts, block.block_id)      # saved, not on disk yet: from the writer's copy
                continue
            path = block_path(self.dir, block.key, block.depth)
            try:
                payload = read_block(path, self._fmt, block.key, block.depth)
            except FileNotFoundError:          # evicted meanwhile (by another engine on this folder, too)
                self._invalid.append(block.key)
                return n
            except CorruptBlock as exc:
                logger.info("KV disk tier: %s is unusable (%s): deleted, its tokens are computed", path, exc)
                self._invalid.append(block.key)
                _remove(path)
                return n
            except OSError as exc:
                if not self._read_warned:
                    self._read_warned = True
                    logger.warning("KV disk tier: cannot read %s (%s); such blocks are computed instead", path,
                                   exc.strerror or exc)
                self._invalid.append(block.key)
                return n
            self._copy_in(payload, block.block_id)
        return len(blocks)

    def _copy_in(self, payload: bytearray, block_id: int) -> None:
        offset = 0
        raw = torch.frombuffer(payload, dtype=torch.uint8)
        for cache in self._caches:
            size = cache[:, block_id].numel() * cache.element_size()
            part = raw[offset:offset + size].view(cache.dtype).view(cache[:, block_id].shape)
            cache[:, block_id].copy_(part)
            offset += size

    def _copy_parts(self, parts: list[torch.Tensor], block_id: int) -> None:
        for cache, part in zip(self._caches, parts):
            cache[:, block_id].copy_(part)

    def wait_for_layer_load(self, layer_index: int) -> None:
        pass                               # start_load_kv finished every layer before the forward

    # ---------------------------------------------------------------- saves

    def save_kv_layer(self, layer_index: int, kv_layer: torch.Tensor) -> None:
        meta = self._metadata
        if meta is None or not meta.saves or self._writer is None:
            return
        if self._save_ids is None:
            self._save_ids = torch.tensor([b.block_id for b in meta.saves], device=kv_layer.device)
        self._gathered.append(kv_layer.index_select(1, self._save_ids))    # a copy: the pool may reuse the blocks

    def wait_for_save(self) -> None:
        meta = self._metadata
        if meta is None or not meta.saves or self._writer is None or not self._gathered:
            return
        event = None
        if self._gathered[0].device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        targets = [(block_path(self.dir, b.key, b.depth), b.key, b.depth, b.parent) for b in meta.saves]
        batch = SaveBatch(targets, self._gathered, event, len(targets) * self._fmt.nbytes)
        if self.config.shared:
            self._writer.write_now(batch)
        else:
            self._writer.submit(batch)
        self._gathered, self._save_ids = [], None

    def get_finished(self, finished_req_ids: list[str]) -> KVConnectorOutput | None:
        out = KVConnectorOutput(finished_recving=self._finished_loads, invalid_keys=self._invalid,
                                load_bytes=self._load_bytes, load_time_s=self._load_time_s)
        self._finished_loads, self._invalid, self._load_bytes, self._load_time_s = {}, [], 0, 0.0
        if self._writer is not None:
            results = self._writer.take_results()
            out.saved, out.failed_saves, out.saves_disabled = results.saved, results.failed, results.disabled
            out.store_time_s = results.seconds
        if not (out.finished_recving or out.invalid_keys or out.saved or out.failed_saves or out.saves_disabled):
            return None
        return out

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close(SHUTDOWN_FLUSH_S)


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass                               # already gone, or a read-only folder: it stays a miss either way


def make_worker_connector(config: KVTransferConfig | None) -> KVConnectorWorker | None:
    if config is None:
        return None
    return DiskOffloadingWorker(config)
