"""Block files of the disk tier (common/kv_transfer/layout.py): written by a thread of their own, read and
checked whole before any byte reaches the KV cache."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
import zlib
from dataclasses import dataclass, field

import torch

from pagedserve.common.kv_transfer.layout import (HEADER_PREFIX, TMP_SUFFIX, CorruptBlock, header_size,
                                                   pack_header, unpack_header)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockFormat:
    """What every block file of this engine holds: checked field by field on every read."""
    namespace: str
    dtype: str                      # the cache dtype, torch's name ("torch.bfloat16")
    shapes: tuple[tuple[int, ...], ...]   # one [2, kv_heads, block_size, head_dim] per cache (layer)
    nbytes: int                     # the payload: every cache's block, one after the other

    def header(self, key: bytes, depth: int, crc: int, parent: bytes = b"") -> bytes:
        # parent: not checked on read (the key already chains it); the restart's index learns chains from it
        return pack_header({"namespace": self.namespace, "key": key.hex(), "depth": depth, "dtype": self.dtype,
                            "shapes": [list(s) for s in self.shapes], "nbytes": self.nbytes, "crc32": crc,
                            "parent": parent.hex()})

    def check(self, fields: dict, key: bytes, depth: int) -> int:
        """The payload's checksum from a header that describes this very block; CorruptBlock otherwise."""
        want = {"namespace": self.namespace, "key": key.hex(), "depth": depth, "dtype": self.dtype,
                "shapes": [list(s) for s in self.shapes], "nbytes": self.nbytes}
        for name, value in want.items():
            if fields.get(name) != value:
                raise CorruptBlock(f"foreign block: {name} is {fields.get(name)!r}, not {value!r}")
        crc = fields.get("crc32")
        if not isinstance(crc, int):
            raise CorruptBlock("no checksum")
        return crc


def read_block(path: str, fmt: BlockFormat, key: bytes, depth: int) -> bytearray:
    """The payload of a block file, whole and checked. FileNotFoundError: not there; CorruptBlock: damaged,
    truncated or foreign (the caller deletes it); another OSError: the disk failed."""
    with open(path, "rb") as f:
        prefix = f.read(HEADER_PREFIX)
        size = header_size(prefix)
        crc = fmt.check(unpack_header(prefix + f.read(size - HEADER_PREFIX)), key, depth)
        payload = bytearray(fmt.nbytes)
        if f.readinto(payload) != fmt.nbytes:
            raise CorruptBlock("truncated")
        if f.read(1):
            raise CorruptBlock("longer than its header says")
    if zlib.crc32(payload) != crc:
        raise CorruptBlock("checksum mismatch")
    return payload


def write_block(path: str, fmt: BlockFormat, key: bytes, depth: int, parts: list[torch.Tensor],
                parent: bytes = b"") -> int:
    """Write a block (its caches' parts, contiguous CPU tensors) to a temporary file renamed into place:
    a reader sees the whole file or none. Returns the file's bytes."""
    views = [p.view(torch.uint8).numpy() for p in parts]
    crc = 0
    for view in views:
        crc = zlib.crc32(view, crc)
    header = fmt.header(key, depth, crc, parent)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.{threading.get_ident()}{TMP_SUFFIX}"
    try:
        with open(tmp, "wb") as f:
            f.write(header)
            for view in views:
                f.write(view)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return len(header) + fmt.nbytes


@dataclass
class SaveBatch:
    """One step's blocks: paths and keys, and each cache's gathered [2, n, ...] copy (device or CPU)."""
    targets: list[tuple[str, bytes, int, bytes]]  # (path, key, depth, parent key) of block j
    gathered: list[torch.Tensor]
    event: torch.cuda.Event | None = None        # CUDA: the gather is done once this fires
    nbytes: int = 0


@dataclass
class WriterResults:
    saved: list[tuple[bytes, int]] = field(default_factory=list)
    failed: list[bytes] = field(default_factory=list)
    disabled: bool = False
    seconds: float = 0.0            # the saved blocks' writes took


class BlockWriter:
    """Writes SaveBatches on its own thread: the step only hands them over. Past max_pending_bytes waiting,
    a batch is dropped (reported failed) rather than stalling the step; the first I/O error stops saving."""

    def __init__(self, fmt: BlockFormat, max_pending_bytes: int) -> None:
        self.fmt = fmt
        self.max_pending = max_pending_bytes
        self._queue: queue.Queue[SaveBatch | None] = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._results = WriterResults()
        # key -> (batch, j): blocks handed over and not yet on disk. A preempted request resuming at once
        # loads them from here (its swap-in), so it never waits for, nor misses, a write still queued.
        self._unwritten: dict[bytes, tuple[SaveBatch, int]] = {}
        self.disabled = False
        self._thread = threading.Thread(target=self._run, name="kv-disk-writer", daemon=True)
        self._thread.start()

    def submit(self, batch: SaveBatch) -> None:
        with self._lock:
            if self.disabled or self._pending + batch.nbytes > self.max_pending:
                self._results.failed.extend(t[1] for t in batch.targets)
                return
            self._pending += batch.nbytes
            self._unwritten.update((t[1], (batch, j)) for j, t in enumerate(batch.targets))
        self._queue.put(batch)

    def unwritten(self, key: bytes) -> list[torch.Tensor] | None:
        """A block handed over and not on disk yet: each cache's part of it (read only), or None."""
        with self._lock:
            found = self._unwritten.get(key)
        if found is None:
            return None
        batch, j = found
        if batch.event is not None:
            batch.event.synchronize()
        return [g[:, j] for g in batch.gathered]

    def write_now(self, batch: SaveBatch) -> None:
        """Write on the caller's thread (shared storage: the step's blocks are on disk before its output
        leaves the engine, so a decode instance asked next finds them)."""
        if not self.disabled:
            self._write(batch)
            return
        with self._lock:
            self._results.failed.extend(t[1] for t in batch.targets)

    def take_results(self) -> WriterResults:
        with self._lock:
            results, self._results = self._results, WriterResults()
        return results

    def _run(self) -> None:
        while (batch := self._queue.get()) is not None:
            try:
                self._write(batch)
            finally:
                with self._lock:
                    self._pending -= batch.nbytes

    def _write(self, batch: SaveBatch) -> None:
        if batch.event is not None:
            batch.event.synchronize()
        host = [g.cpu() for g in batch.gathered]
        for j, (path, key, depth, parent) in enumerate(batch.targets):
            if self.disabled:
                with self._lock:
                    self._results.failed.append(key)
                    self._forget(key, batch)
                continue
            t0 = time.perf_counter()
            try:
                nbytes = write_block(path, self.fmt, key, depth, [h[:, j].contiguous() for h in host], parent)
            except OSError as exc:
                logger.warning("KV disk tier: cannot write %s (%s): saving stops; requests recompute what the "
                               "tier lacks", path, exc.strerror or exc)
                with self._lock:
                    self.disabled = True
                    self._results.disabled = True
                    self._results.failed.append(key)
                    self._forget(key, batch)
                continue
            with self._lock:            # on disk now (renamed into place): a reader finds the file
                self._results.saved.append((key, nbytes))
                self._results.seconds += time.perf_counter() - t0
                self._forget(key, batch)

    def _forget(self, key: bytes, batch: SaveBatch) -> None:
        # Under the lock. A later batch may hold the same key again (saved twice after an eviction): keep it.
        if (found := self._unwritten.get(key)) is not None and found[0] is batch:
            del self._unwritten[key]

    def close(self, timeout_s: float) -> None:
        """Let the blocks handed over so far reach the disk (a restart finds them), at most timeout_s."""
        self._queue.put(None)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.warning("KV disk tier: %d bytes of blocks not written after %.0f s at shutdown",
                           self._pending, timeout_s)
