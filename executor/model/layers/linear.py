"""Linear layers split across tensor-parallel ranks; each parameter knows how to load its shard.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`: the model hands it the
full checkpoint tensor and the layer copies out the slice this rank owns.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor.model.parallel_state import TPGroup, split_evenly
from pagedserve.kernels import ops


def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst.copy_(src) after a shape check; copy_ also converts dtype and device."""
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match the parameter's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)


def _empty_param(*shape: int) -> nn.Parameter:
    # torch.empty: the loader overwrites every value, so random init would be wasted work.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(nn.Module):
    """y = x W^T (+ b) over this rank's slice of W; subclasses decide the slice."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.in_features, self.out_features = in_features, out_features
        self.weight = _empty_param(out_features, in_features)
        self.bias = _empty_param(out_features) if bias else None
        for param in (self.weight, self.bias):
            if param is not None:
                param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.linear(x, self.weight, self.bias)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, split_evenly(out_features, tp, "output features"), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        size = param.shape[0]
        copy_weight(param.data, loaded_weight.narrow(0, self.tp.rank * size, size), type(self).__name__)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate and up): shard i fills block i."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        self.local_sizes = [split_evenly(size, tp, "merged output features") for size in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"MergedColumnParallelLinear: shard_id must be an int in "
                             f"[0, {len(self.local_sizes)}), got {shard_id!r}")
        size = self.local_sizes[shard_id]
        dst = param.data.narrow(0, sum(self.local_sizes[:shard_id]), size)
        copy_weight(dst, loaded_weight.narrow(0, self.tp.rank * size, size), f"merged shard {shard_id}")


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v in one matmul, heads split across ranks.

    With more ranks than KV heads each KV head is replicated: rank r holds KV head
    r * num_kv_heads // tp_size (the query heads it serves belong to that KV head's group).
    """

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool,
                 tp: TPGroup) -> None:
        if num_kv_heads % tp.size and tp.size % num_kv_heads:
            raise ValueError(f"num_key_value_heads ({num_kv_heads}) and tensor_parallel_size ({tp.size}): "
                             "one must divide the other")
        self.head_dim = head_dim
        self.total_kv_heads = num_kv_heads
        self.num_heads = split_evenly(num_heads, tp, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        self.q_size = self.num_heads * head_dim
        self.kv_size = self.num_kv_heads * head_dim
        out = (num_heads + 2 * self.num_kv_heads * tp.size) * head_dim   # split back to q + 2 kv per rank
        super().__init__(hidden_size, out, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            first_head = self.tp.rank * self.total_kv_heads // self.tp.size
            size, start = self.kv_size, first_head * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        copy_weight(param.data.narrow(0, offset, size), loaded_weight.narrow(0, start, size),
                    f"qkv shard {shard_id}")


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(split_evenly(in_features, tp, "input features"), out_features, bias, tp)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if param.dim() == 1:            # the bias is whole on every rank: added once, after the reduce
            copy_weight(param.data, loaded_weight, "RowParallelLinear bias")
            return
        size = param.shape[1]
        copy_weight(param.data, loaded_weight.narrow(1, self.tp.rank * size, size), "RowParallelLinear")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return ops.linear(x, self.weight, self.bias)
        out = self.tp.all_reduce(ops.linear(x, self.weight))
        return out if self.bias is None else out + self.bias
