"""Linear layers split across tensor-parallel ranks; each parameter knows how to load its shard."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.parallel_state import TPGroup, split_evenly


class _Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        # torch.empty: the loader fills every value, so no random init work.
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        for p in (self.weight, self.bias):
            if p is not None:
                p.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        _copy(param.data, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight shape {tuple(src.shape)} does not match the parameter's {tuple(dst.shape)}")
    dst.copy_(src)


class ReplicatedLinear(_Linear):
    pass


class ColumnParallelLinear(_Linear):
    """Output features split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        self.tp = tp
        super().__init__(in_features, split_evenly(out_features, tp, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        size = param.shape[0]
        _copy(param.data, loaded.narrow(0, self.tp.rank * size, size))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate and up projections)."""

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        self.out_sizes = out_sizes
        super().__init__(in_features, sum(out_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError("MergedColumnParallelLinear needs an integer shard id")
        size = self.out_sizes[shard_id] // self.tp.size
        offset = sum(self.out_sizes[:shard_id]) // self.tp.size
        _copy(param.data.narrow(0, offset, size), loaded.narrow(0, self.tp.rank * size, size))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matmul. With more ranks than KV heads, KV heads are replicated."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup) -> None:
        self.head_dim = head_dim
        self.num_heads = split_evenly(num_heads, tp, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim
        self.tp = tp
        _Linear.__init__(self, hidden, out, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, start = param.data.narrow(0, 0, q_size), self.tp.rank * q_size
        elif shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            dst, start = param.data.narrow(0, offset, kv_size), (self.tp.rank // self.kv_replicas) * kv_size
        else:
            raise ValueError(f"QKVParallelLinear shard id must be q, k or v, got {shard_id!r}")
        _copy(dst, loaded.narrow(0, start, dst.shape[0]))


class RowParallelLinear(_Linear):
    """Input features split across ranks; partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        self.tp = tp
        super().__init__(split_evenly(in_features, tp, "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if param.dim() == 1:                  # the bias is added once, after the reduce
            _copy(param.data, loaded)
            return
        size = param.shape[1]
        _copy(param.data, loaded.narrow(1, self.tp.rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.tp.all_reduce(F.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
