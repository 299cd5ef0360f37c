"""Linear layers split across tensor-parallel ranks; each parameter knows how to load its shard.

Every parameter carries `weight_loader(param, loaded_weight, shard_id=None)`: the model hands it the
full checkpoint tensor and the layer copies out the slice this rank owns. Each layer knows its slice once
(`shard`); a dense layer copies it into its weight, a quantized one (after `begin_packed_load`) keeps the
pieces, which may be quantized (GroupQuantWeight slices like a tensor), and packs them for its kernel in
`finish_packed_load`, which also picks the layer's linear method (layers/linear_method.py).

The contract a wrapper (LoRA) can rely on: `forward(x [..., in_features]) -> [..., out_features]` and
`method.apply(self, x, bias)` computes this rank's x @ W_local^T (+ bias) with no communication.
in_features / out_features are this rank's sizes: a column-parallel layer's output is its slice of the
output features (`output_partition_sizes`: its sub-projections' local sizes, e.g. q, k, v), a row-parallel
layer's input is its slice of the input features and its forward all-reduces the partial products before
adding the bias once.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor.model.layers.lora import LoRASlots
from pagedserve.executor.model.layers.linear_method import LinearMethod, dense_linear_method, linear_method_for
from pagedserve.executor.model.parallel_state import TPGroup, split_evenly
from pagedserve.executor.model.layers.packed_pieces import PackedPieces
from pagedserve.executor.model.quant.packing import Packed, Piece, pack_linear


def copy_weight(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst.copy_(src) after a shape check; copy_ also converts dtype and device."""
    if dst.shape != src.shape:
        raise ValueError(f"{what}: checkpoint shape {tuple(src.shape)} does not match the parameter's "
                         f"{tuple(dst.shape)}")
    dst.copy_(src)


def check_checkpoint_shape(loaded_weight, expected: tuple[int, ...], what: str) -> None:
    """The whole checkpoint tensor's shape, checked before a rank takes its slice: a slice of a wider tensor
    would otherwise fit and load silently (issue 30: a [128, 264] down_proj narrowed to [128, 256])."""
    if tuple(loaded_weight.shape) != tuple(expected):
        raise ValueError(f"{what}: checkpoint shape {tuple(loaded_weight.shape)} does not match the model's "
                         f"{tuple(expected)}")


def _empty_param(*shape: int) -> nn.Parameter:
    # torch.empty: the loader overwrites every value, so random init would be wasted work.
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class LinearBase(PackedPieces, nn.Module):
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
        self.packed: Packed | None = None        # the kernel's form, for quantized layers
        self._pieces: list[Piece] | None = None   # while a quantized layer loads
        self.output_partition_sizes = [out_features]
        self.method: LinearMethod = dense_linear_method(self.weight.device)
        self.lora: LoRASlots | None = None       # adapter slots (layers/lora.py), set when LoRA is enabled

    def shard(self, loaded_weight, shard_id: int | str | None) -> tuple[int, object]:
        """(first row of this rank's weight it fills, the checkpoint rows/columns this rank owns)."""
        raise NotImplementedError

    def checkpoint_rows(self, shard_id: int | str | None) -> int:
        """Rows of the whole checkpoint tensor `shard_id` names (all ranks' slices together)."""
        raise NotImplementedError

    def checkpoint_shape(self, loaded_weight, shard_id: int | str | None) -> tuple[int, ...]:
        """The shape the whole checkpoint tensor must have: a weight [rows, in] or a bias [rows]."""
        rows = self.checkpoint_rows(shard_id)
        return (rows,) if loaded_weight.dim() == 1 else (rows, self.in_features)

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: int | str | None = None) -> None:
        what = f"{type(self).__name__}{'' if shard_id is None else f' shard {shard_id}'}"
        check_checkpoint_shape(loaded_weight, self.checkpoint_shape(loaded_weight, shard_id), what)
        row, src = self.shard(loaded_weight, shard_id)
        if param is self.weight and self._pieces is not None:
            self._pieces.append((row, src))
            return
        copy_weight(param.data.narrow(0, row, src.shape[0]), src, what)

    def piece_rows(self) -> int:
        """Rows the pieces of a complete weight cover."""
        return self.out_features

    def finish_packed_load(self, method: str, device: torch.device, dtype: torch.dtype) -> bool:
        """Pack the collected pieces (a layer that got none keeps its weight). True when the weight's tensors
        were replaced rather than overwritten in place (see set_weight_form)."""
        pieces = self.take_pieces()
        if not pieces:
            return False
        return self.set_weight_form(pack_linear(pieces, self.out_features, method, device, dtype,
                                                type(self).__name__), device)

    def set_weight_form(self, packed: Packed, device: torch.device) -> bool:
        """Install a packed weight (PackedPieces._install_form); a replaced weight gets its linear method."""
        replaced = self._install_form(packed, device)
        if replaced:
            self.method = linear_method_for(packed, device)
        return replaced

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._with_lora(x, self.method.apply(self, x, self.bias))

    def _with_lora(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return y if self.lora is None else self.lora.apply(x, y)


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; each rank's output is its slice (no communication)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__(in_features, split_evenly(out_features, tp, "output features"), bias, tp)

    def checkpoint_rows(self, shard_id: int | str | None) -> int:
        return self.out_features * self.tp.size

    def shard(self, loaded_weight, shard_id: int | str | None) -> tuple[int, object]:
        size = self.out_features
        return 0, loaded_weight.narrow(0, self.tp.rank * size, size)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel projections in one matmul (gate and up): shard i fills block i."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool, tp: TPGroup) -> None:
        self.local_sizes = [split_evenly(size, tp, "merged output features") for size in output_sizes]
        super().__init__(in_features, sum(output_sizes), bias, tp)
        self.output_partition_sizes = list(self.local_sizes)

    def checkpoint_rows(self, shard_id: int | str | None) -> int:
        self._check_shard_id(shard_id)
        return self.local_sizes[shard_id] * self.tp.size

    def _check_shard_id(self, shard_id: int | str | None) -> None:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.local_sizes):
            raise ValueError(f"MergedColumnParallelLinear: shard_id must be an int in "
                             f"[0, {len(self.local_sizes)}), got {shard_id!r}")

    def shard(self, loaded_weight, shard_id: int | str | None) -> tuple[int, object]:
        self._check_shard_id(shard_id)
        size = self.local_sizes[shard_id]
        return sum(self.local_sizes[:shard_id]), loaded_weight.narrow(0, self.tp.rank * size, size)


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
        self.output_partition_sizes = [self.q_size, self.kv_size, self.kv_size]

    def checkpoint_rows(self, shard_id: int | str | None) -> int:
        if shard_id == "q":
            return self.q_size * self.tp.size
        if shard_id in ("k", "v"):
            return self.total_kv_heads * self.head_dim
        raise ValueError(f"QKVParallelLinear: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")

    def shard(self, loaded_weight, shard_id: int | str | None) -> tuple[int, object]:
        if shard_id == "q":
            offset, size, start = 0, self.q_size, self.tp.rank * self.q_size
        elif shard_id in ("k", "v"):
            offset = self.q_size if shard_id == "k" else self.q_size + self.kv_size
            first_head = self.tp.rank * self.total_kv_heads // self.tp.size
            size, start = self.kv_size, first_head * self.head_dim
        else:
            raise ValueError(f"QKVParallelLinear: shard_id must be 'q', 'k' or 'v', got {shard_id!r}")
        return offset, loaded_weight.narrow(0, start, size)


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial products are summed with an all-reduce.

    reduce_results=False: forward returns this rank's partial product (rank 0's with the bias), for a caller
    that adds more partial sums and reduces once (vLLM's flag)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup,
                 reduce_results: bool = True) -> None:
        super().__init__(split_evenly(in_features, tp, "input features"), out_features, bias, tp)
        self.reduce_results = reduce_results

    def checkpoint_rows(self, shard_id: int | str | None) -> int:
        return self.out_features

    def checkpoint_shape(self, loaded_weight, shard_id: int | str | None) -> tuple[int, ...]:
        return (self.out_features,) if loaded_weight.dim() == 1 else (self.out_features, self.in_features * self.tp.size)

    def shard(self, loaded_weight, shard_id: int | str | None) -> tuple[int, object]:
        if loaded_weight.dim() == 1:    # the bias is whole on every rank: added once, after the reduce
            return 0, loaded_weight
        size = self.in_features
        return 0, loaded_weight.narrow(1, self.tp.rank * size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # An adapter's partial delta joins the partial products before the reduce, which sums both.
        if self.tp.size == 1:
            return self._with_lora(x, self.method.apply(self, x, self.bias))
        if not self.reduce_results:
            return self._with_lora(x, self.method.apply(self, x, self.bias if self.tp.rank == 0 else None))
        out = self.tp.all_reduce(self._with_lora(x, self.method.apply(self, x, None)))
        return out if self.bias is None else out + self.bias
