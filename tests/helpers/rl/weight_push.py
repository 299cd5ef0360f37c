"""Push a list of checkpoint-named tensors into a running LLM over a weight sync group, as a trainer does: the
trainer side (rank 0) runs on a thread of the test process while the engine receives them through
collective_rpc("update_weights_from_distributed"). Quantized checkpoints' tensors go as they are stored
(int32 qweight, float16 scales, GGUF blocks as raw bytes with their ggml type as the dtype)."""
from __future__ import annotations

import threading
from typing import Any

import torch

from pagedserve.executor.model.quant.gguf_blocks import GGUFBlocks
from pagedserve.executor.worker.rl.weight_sync import WeightSyncGroup
from pagedserve.tests.helpers.processes.server import free_port


def describe(tensors: list[tuple[str, Any]]) -> tuple[list[str], list[str], list[list[int]]]:
    """The (names, dtypes, shapes) the engine receives the tensors by."""
    dtypes = [t.tensor_type if isinstance(t, GGUFBlocks) else str(t.dtype) for _, t in tensors]
    return [n for n, _ in tensors], dtypes, [list(t.shape) for _, t in tensors]


def _payload(t: Any) -> torch.Tensor:
    return (t.data if isinstance(t, GGUFBlocks) else t).contiguous()


class Trainer:
    """Rank 0 of a group with `engine_ranks` engine ranks; use as a context manager around the pushes."""

    def __init__(self, llm: Any, engine_ranks: int = 1) -> None:
        self.llm, self.port, self.world = llm, free_port(), 1 + engine_ranks
        self.group: WeightSyncGroup | None = None

    def __enter__(self) -> Trainer:
        joined = threading.Thread(target=self._join)
        joined.start()
        self.llm.collective_rpc("init_weight_update_group", args=("127.0.0.1", self.port, 1, self.world))
        joined.join(60)
        return self

    def _join(self) -> None:
        self.group = WeightSyncGroup("127.0.0.1", self.port, 0, self.world)

    def push(self, tensors: list[tuple[str, Any]], names: list[str] | None = None) -> list[Any]:
        """Broadcast every tensor while the engine receives them (under `names` if given); the engine's answer
        (one per rank), or its error raised here."""
        sender = threading.Thread(target=lambda: [self.group.broadcast(_payload(t), src=0) for _, t in tensors])
        sender.start()
        try:
            got, dtypes, shapes = describe(tensors)
            return self.llm.collective_rpc("update_weights_from_distributed", args=(names or got, dtypes, shapes))
        finally:
            sender.join(60)

    def __exit__(self, *exc: object) -> None:
        self.llm.collective_rpc("destroy_weight_update_group")
