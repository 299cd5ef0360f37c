"""The tensor-parallel group and the pipeline stage a model is built for (passed in, never global)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    # The torch.distributed group of this stage's ranks; None: the whole world (no pipeline stages).
    group: Any = field(default=None, compare=False)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim (same shape on every rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class PPGroup:
    """This rank's pipeline stage: which layers it holds, and the ranks before and after it."""
    rank: int = 0                 # the stage
    size: int = 1                 # stages
    tp_size: int = 1
    tp_rank: int = 0

    @property
    def is_first(self) -> bool:
        return self.rank == 0

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def layers(self, num_layers: int) -> range:
        return stage_layers(num_layers, self.rank, self.size)

    def _peer(self, stage: int) -> int:
        return stage * self.tp_size + self.tp_rank

    def send(self, tensors: tuple[torch.Tensor, ...]) -> list[Any]:
        """Start sending this stage's activations to the same TP rank of the next stage; the caller keeps the
        returned handles (and so the tensors) until they complete."""
        return [dist.isend(t.contiguous(), dst=self._peer(self.rank + 1)) for t in tensors]

    def recv(self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device,
             count: int) -> tuple[torch.Tensor, ...]:
        out = tuple(torch.empty(shape, dtype=dtype, device=device) for _ in range(count))
        for t in out:
            dist.recv(t, src=self._peer(self.rank - 1))
        return out


def stage_layers(num_layers: int, stage: int, stages: int) -> range:
    """The layers of one stage, by count; the stages before the last take the remainder (vLLM's split: the
    last stage also runs the final norm and the LM head)."""
    sizes = [num_layers // stages] * stages
    for i in range(num_layers % stages):
        sizes[-2 - i if stages > 1 else 0] += 1
    start = sum(sizes[:stage])
    return range(start, start + sizes[stage])


def split_evenly(total: int, tp: TPGroup, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({tp.size})")
    return total // tp.size
