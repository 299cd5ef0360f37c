"""The tensor-parallel group a model is built for (passed in, never global)."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along dim (same shape on every rank)."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous())
        return torch.cat(parts, dim=dim)


def split_evenly(total: int, tp: TPGroup, what: str) -> int:
    if total % tp.size:
        raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({tp.size})")
    return total // tp.size
