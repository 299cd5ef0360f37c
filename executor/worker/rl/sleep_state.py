"""Sleep mode on one rank: release the KV cache (level 1) and the weights (level 2), and bring them back.

A tensor's memory is released by shrinking its storage to nothing, which frees it (on CPU a large block goes
back to the OS, so the process's RSS drops; on CUDA the caching allocator holds it for reuse until
empty_cache). The tensor objects stay where the model and the attention layers bind them; waking grows the
storages back. Level 1 on CUDA copies the weights to host memory first; on CPU the weights are host memory
already, so level 1 keeps them and releases only the KV cache. Level 2 discards the weights: after waking
them, their values are undefined until reload_weights or a full weight update (vLLM's contract).

The weights are the parameters and a quantized model's packed weights (quant/loading.packed_tensors). A
storage that grows back has a new address: CUDA graphs captured against the old ones are captured again, and
the C decode step of a quantized CPU model is built again.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
from typing import Any

import torch

from pagedserve.executor.model.quant.loading import packed_tensors

logger = logging.getLogger(__name__)

TAGS = ("weights", "kv_cache")
_MADV_DONTNEED = 4     # Linux


def _unique_storages(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """One tensor per storage (a tied embedding and LM head share one)."""
    seen: set[int] = set()
    out = []
    for t in tensors:
        ptr = t.untyped_storage().data_ptr()
        if t.untyped_storage().nbytes() and ptr not in seen:
            seen.add(ptr)
            out.append(t)
    return out


def _discard_pages(t: torch.Tensor) -> None:
    """Give a CPU tensor's pages back to the OS, keeping its address: the CPU KV cache is an anonymous mapping
    (model_runner._zeros), whose pages read as zero again when next touched (madvise MADV_DONTNEED)."""
    libc = ctypes.CDLL(None, use_errno=True)
    page = mmap.PAGESIZE
    start = t.untyped_storage().data_ptr()
    first = -(-start // page) * page
    end = (start + t.untyped_storage().nbytes()) // page * page
    if end > first and libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(end - first), _MADV_DONTNEED):
        raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on the KV cache")


def _trim_heap() -> None:
    """Hand freed heap memory back to the OS: glibc keeps blocks under its (adaptive) mmap threshold in its
    arenas after free(), so without this a released weight may stay resident."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except AttributeError:          # not glibc: its allocator decides
        pass


class _Released:
    """Tensors whose memory was released: their sizes, and host copies where kept. A storage torch allocated
    shrinks to nothing; an anonymous mapping (the CPU KV cache) keeps its address and drops its pages."""

    def __init__(self, tensors: list[torch.Tensor], keep_on_host: bool) -> None:
        self.items: list[tuple[torch.Tensor, int, torch.Tensor | None]] = []
        for t in _unique_storages(tensors):
            storage = t.untyped_storage()
            if not storage.resizable() and t.device.type == "cpu":
                _discard_pages(t)
                self.items.append((t, storage.nbytes(), None))
                continue
            host = None
            if keep_on_host:
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=torch.cuda.is_available())
                host.untyped_storage().copy_(storage)
            self.items.append((t, storage.nbytes(), host))
            storage.resize_(0)

    @property
    def nbytes(self) -> int:
        return sum(n for _, n, _ in self.items)

    def restore(self, zero: bool) -> None:
        for t, nbytes, host in self.items:
            storage = t.untyped_storage()
            if not storage.resizable():      # a mapping whose pages were dropped: they read as zero already
                continue
            storage.resize_(nbytes)
            if host is not None:
                storage.copy_(host.untyped_storage())
            elif zero:      # attention reads whole blocks: a NaN left in free memory poisons outputs
                t.zero_()


class SleepState:
    def __init__(self, runner: Any, device: torch.device) -> None:
        self.runner, self.device = runner, device
        self.weights: _Released | None = None
        self.kv: _Released | None = None
        self.weights_lost = False         # level 2: values undefined until reloaded

    def _kv_tensors(self) -> list[torch.Tensor]:
        return list(self.runner.kv_caches) + list(getattr(self.runner, "draft_caches", None) or [])

    def _weight_tensors(self) -> list[torch.Tensor]:
        models = [self.runner.model]
        drafter = getattr(self.runner, "drafter", None)
        if drafter is not None:
            models.append(drafter.model)
        return [t for m in models for t in [p.data for p in m.parameters()] + packed_tensors(m)]

    def sleep(self, level: int) -> dict[str, Any]:
        if level not in (1, 2):
            raise ValueError(f"sleep: level must be 1 or 2, got {level}")
        freed = 0
        if self.kv is None:
            self.kv = _Released(self._kv_tensors(), keep_on_host=False)
            freed += self.kv.nbytes
        if self.weights is None and (level == 2 or self.device.type == "cuda"):
            self.weights = _Released(self._weight_tensors(), keep_on_host=level == 1)
            self.weights_lost = level == 2
            freed += self.weights.nbytes
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        else:
            _trim_heap()
        logger.info("asleep (level %d): released %.1f MiB", level, freed / 2**20)
        return {"level": level, "released_bytes": freed}

    def wake_up(self, tags: list[str] | None) -> dict[str, Any]:
        tags = list(TAGS) if tags is None else list(tags)
        unknown = [t for t in tags if t not in TAGS]
        if unknown:
            raise ValueError(f"wake_up: unknown tags {unknown} (allowed: {', '.join(TAGS)})")
        woke = []
        if "weights" in tags and self.weights is not None:
            self.weights.restore(zero=False)
            self.weights = None
            woke.append("weights")
        if "kv_cache" in tags and self.kv is not None:
            self.kv.restore(zero=True)
            self.kv = None
            woke.append("kv_cache")
        if woke and self.device.type == "cuda" and getattr(self.runner, "graphs", None) is not None \
                and self.kv is None and self.weights is None:
            self.runner.capture_cuda_graphs()
        elif "weights" in woke and self.device.type == "cpu":
            self.runner.rebind_weights()        # the C decode step of a quantized model reads the new addresses
        return {"woke": woke, "weights_need_reload": self.weights_lost}

    def weights_usable(self) -> bool:
        return self.weights is None

    def weights_reloaded(self) -> None:
        if self.weights is not None:
            raise ValueError("reload_weights: the weights are asleep; wake_up(tags=['weights']) first")
        self.weights_lost = False
