"""The worker's side of RL weight syncing and sleep mode: WorkerRL, which a Worker holds as `worker.rl`
(executor/worker/worker.py), as the engine core holds its RLControl.

Every method of WorkerRL.METHODS is reachable through collective_rpc; arguments and results are JSON-able
data, tensors come from disk or over the weight sync group, never through the call.
"""
from __future__ import annotations

import logging
import time
from typing import Any, ClassVar, Protocol

import torch

from pagedserve.executor.model.quant.gguf_blocks import GGUF_QUANT_TYPES, GGUFBlocks, gguf_nbytes
from pagedserve.executor.worker.rl.model_update import WeightUpdater, nbytes
from pagedserve.executor.worker.rl.sleep_state import SleepState
from pagedserve.executor.worker.rl.weight_sync import WeightSyncGroup

logger = logging.getLogger(__name__)

# Floats, and the integer and fp8 tensors of quantized checkpoints (AWQ/GPTQ qweight, qzeros, g_idx; fp8
# weights).
_TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
                 "float64": torch.float64, "int32": torch.int32, "int64": torch.int64, "int16": torch.int16,
                 "int8": torch.int8, "uint8": torch.uint8, "float8_e4m3fn": torch.float8_e4m3fn}


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' or 'torch.bfloat16' -> torch.bfloat16; ValueError naming the choices."""
    key = str(name).removeprefix("torch.")
    if key not in _TORCH_DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_TORCH_DTYPES)} or a GGUF block type "
                         f"({', '.join(GGUF_QUANT_TYPES)}), got {name!r}")
    return _TORCH_DTYPES[key]


def receive_buffer(dtype: str, shape: list[int], device: torch.device) -> torch.Tensor:
    """The tensor a pushed weight is received into: of dtype and shape, or for a GGUF block type ("Q4_0")
    the raw bytes of a tensor of that (outermost first) shape."""
    dims = tuple(int(d) for d in shape)
    if str(dtype) in GGUF_QUANT_TYPES:
        return torch.empty(gguf_nbytes(str(dtype), dims), dtype=torch.uint8, device=device)
    return torch.empty(dims, dtype=torch_dtype(dtype), device=device)


class _WorkerParts(Protocol):
    """What WorkerRL reads of its worker, at each call: the runner exists only once the model is loaded."""
    rank: int
    config: Any
    tp: Any
    pp: Any
    device: torch.device
    runner: Any


class WorkerRL:
    METHODS: ClassVar[frozenset[str]] = frozenset({
        "reload_weights", "init_weight_update_group", "update_weights_from_distributed", "update_weight",
        "destroy_weight_update_group", "sleep", "wake_up"})

    def __init__(self, worker: _WorkerParts) -> None:
        self.worker = worker
        self._updater: WeightUpdater | None = None
        self._sync_group: WeightSyncGroup | None = None
        self._sleep: SleepState | None = None

    def weight_updater(self) -> WeightUpdater:
        if self._updater is None:
            w = self.worker
            self._updater = WeightUpdater(w.runner.model, w.config.model, w.tp, w.pp)
        return self._updater

    def update_weights(self, weights: list[tuple[str, Any]]) -> int:
        """Apply checkpoint-named tensors (in this process: a worker extension's entry point), all or nothing.
        A GGUF model takes its file's names, with GGUFBlocks for quantized tensors (docs/rl_weight_updates.md)."""
        self._check_awake_weights()
        try:
            return self.weight_updater().apply(weights)
        finally:
            self._rebind_weights()

    def reload_weights(self, weights_path: str | None = None) -> str:
        """Every weight again from the model's checkpoint, or from weights_path (same architecture)."""
        if self._sleep is not None:
            self._sleep.weights_reloaded()
        try:
            return self.weight_updater().reload(weights_path)
        finally:
            self._rebind_weights()

    def _rebind_weights(self) -> None:
        # A quantized weight that changed form got new tensors: what holds the old addresses is built again.
        if self._updater is not None and self._updater.take_relinked():
            self.worker.runner.rebind_weights()

    def init_weight_update_group(self, master_address: str, master_port: int, rank_offset: int,
                                 world_size: int) -> int:
        """Join the trainer's group as rank rank_offset + this worker's rank; returns that rank."""
        if self._sync_group is not None:
            raise ValueError("init_weight_update_group: this worker is in a weight update group already "
                             "(destroy_weight_update_group first)")
        rank = int(rank_offset) + self.worker.rank
        self._sync_group = WeightSyncGroup(master_address, int(master_port), rank, int(world_size),
                                           self.worker.device)
        return rank

    def destroy_weight_update_group(self) -> None:
        self._sync_group = None

    def update_weights_from_distributed(self, names: list[str], dtypes: list[str],
                                        shapes: list[list[int]]) -> int:
        """Receive len(names) tensors the trainer (rank 0) broadcasts, in order, then apply them all or none.

        Every tensor is received even when one is wrong, so the trainer is never left waiting; the check
        (names, shapes) then fails before any weight changes."""
        group = self._sync_group
        if group is None:
            raise ValueError("update_weights_from_distributed: call init_weight_update_group first")
        if not len(names) == len(dtypes) == len(shapes):
            raise ValueError(f"update_weights_from_distributed: names ({len(names)}), dtypes ({len(dtypes)}) and "
                             f"shapes ({len(shapes)}) must have the same length")
        start = time.perf_counter()
        received = []
        for name, dtype, shape in zip(names, dtypes, shapes):
            buffer = group.broadcast(receive_buffer(dtype, shape, self.worker.device), src=0)
            if str(dtype) in GGUF_QUANT_TYPES:
                buffer = GGUFBlocks(str(dtype), tuple(int(d) for d in shape), buffer)
            received.append((str(name), buffer))
        got = time.perf_counter()
        applied = self.update_weights(received)
        logger.info("rank %d: received %d tensors (%.1f MiB) in %.3f s, applied in %.3f s", self.worker.rank, applied,
                    sum(nbytes(t) for _, t in received) / 2**20, got - start, time.perf_counter() - got)
        return applied

    def update_weight(self, name: str, dtype: str, shape: list[int]) -> int:
        """vLLM's RLHF example spelling: one tensor."""
        return self.update_weights_from_distributed([name], [dtype], [shape])

    # ---------------------------------------------------------------- sleep mode

    def sleep(self, level: int = 1) -> dict[str, Any]:
        if not self.worker.config.rl.enable_sleep_mode:
            raise ValueError("sleep: the engine was started without enable_sleep_mode")
        if self._sleep is None:
            self._sleep = SleepState(self.worker.runner, self.worker.device)
        return self._sleep.sleep(int(level))

    def wake_up(self, tags: list[str] | None = None) -> dict[str, Any]:
        if self._sleep is None:
            return {"woke": []}
        return self._sleep.wake_up(tags)

    def _check_awake_weights(self) -> None:
        if self._sleep is not None and not self._sleep.weights_usable():
            raise ValueError("weight update: the weights are asleep; wake_up(tags=['weights']) first")
