"""Mixture-of-experts layers: the router (a replicated linear + top-k) and the experts with stacked weights.

Tensor parallelism: every expert's intermediate dimension is split across ranks (gate/up rows, down columns),
so each rank computes a partial sum of every chosen expert's output and one all-reduce completes it.

Checkpoints name experts either one tensor per expert (`experts.{e}.gate_proj/up_proj/down_proj.weight`, or
Mixtral's `w1/w3/w2`) or stacked (`experts.gate_up_proj` [E, 2*I, H] and `experts.down_proj` [E, H, I],
transformers' own layout); `expert_shard` tells the two apart.
"""
from __future__ import annotations

import re

import torch
from torch import nn

from pagedserve.executor.model.layers.linear import check_checkpoint_shape, copy_weight
from pagedserve.executor.model.layers.linear_method import dense_linear_method
from pagedserve.executor.model.parallel_state import TPGroup, split_evenly
from pagedserve.kernels import ops

# checkpoint part name -> our shard id: "w1" gate rows, "w3" up rows, "w2" down columns
_PER_EXPERT = {"gate_proj": "w1", "up_proj": "w3", "down_proj": "w2", "w1": "w1", "w3": "w3", "w2": "w2"}
_STACKED = {"gate_up_proj": "w13", "down_proj": "w2"}
_PER_EXPERT_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<expert>\d+)\.(?P<part>\w+)\.weight$")
_STACKED_RE = re.compile(r"^(?P<prefix>.*\.experts)\.(?P<part>gate_up_proj|down_proj)(?:\.weight)?$")


def expert_shard(name: str) -> tuple[str, str, int | None] | None:
    """Checkpoint name -> (our experts module path, shard id, expert index or None when stacked), or None.

    e.g. model.layers.0.mlp.experts.3.up_proj.weight -> ("model.layers.0.mlp.experts", "w3", 3).
    """
    match = _PER_EXPERT_RE.match(name)
    if match and match["part"] in _PER_EXPERT:
        return match["prefix"], _PER_EXPERT[match["part"]], int(match["expert"])
    match = _STACKED_RE.match(name)
    if match:
        return match["prefix"], _STACKED[match["part"]], None
    return None


def _empty_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape), requires_grad=False)


class Router(nn.Module):
    """The gate: logits [T, E] = x W^T, W [E, H] whole on every rank (it is small and every rank routes)."""

    def __init__(self, hidden_size: int, num_experts: int) -> None:
        super().__init__()
        self.weight = _empty_param(num_experts, hidden_size)
        self.packed = None                   # never quantized
        self.method = dense_linear_method(self.weight.device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self, x, None)


class FusedMoE(nn.Module):
    """E SiLU-gated experts over stacked weights w13 [E, 2*I/tp, H] and w2 [E, H, I/tp].

    forward(x, router_logits) -> this rank's partial sum when `reduce_results` is False (the caller adds
    more partial sums, e.g. a shared expert, and reduces once), else the full output.
    """

    def __init__(self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int,
                 renormalize: bool, tp: TPGroup, reduce_results: bool = True) -> None:
        super().__init__()
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must be in [1, num_experts ({num_experts})]")
        self.tp = tp
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        self.hidden_size, self.intermediate_size = hidden_size, intermediate_size
        self.local_inter = split_evenly(intermediate_size, tp, "expert intermediate size")
        self.reduce_results = reduce_results
        self.w13_weight = _empty_param(num_experts, 2 * self.local_inter, hidden_size)
        self.w2_weight = _empty_param(num_experts, hidden_size, self.local_inter)
        for param in (self.w13_weight, self.w2_weight):
            param.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str,
                      expert: int | None = None) -> None:
        """Copy this rank's slice of one expert's tensor (expert given) or of a stacked [E, ...] tensor."""
        if shard_id not in ("w1", "w3", "w2", "w13"):
            raise ValueError(f"FusedMoE: shard_id must be 'w1', 'w3', 'w2' or 'w13', got {shard_id!r}")
        if expert is not None and not 0 <= expert < self.num_experts:
            raise ValueError(f"FusedMoE: expert {expert} out of range (num_experts {self.num_experts})")
        size, start = self.local_inter, self.tp.rank * self.local_inter
        # One expert is handled as a stack of one, so both forms share the slicing below.
        dst = param.data if expert is None else param.data[expert:expert + 1]
        src = loaded_weight if expert is None else loaded_weight.unsqueeze(0)
        what = f"FusedMoE {shard_id}" + ("" if expert is None else f" expert {expert}")
        check_checkpoint_shape(loaded_weight, self.checkpoint_shape(shard_id, expert is None), what)
        if shard_id == "w2":
            copy_weight(dst, src.narrow(2, start, size), what)
        elif shard_id == "w13":                     # stacked gate rows then up rows, each split across ranks
            half = self.intermediate_size
            copy_weight(dst[:, :size], src.narrow(1, start, size), f"{what} (gate half)")
            copy_weight(dst[:, size:], src.narrow(1, half + start, size), f"{what} (up half)")
        else:
            offset = 0 if shard_id == "w1" else size
            copy_weight(dst[:, offset:offset + size], src.narrow(1, start, size), what)

    def checkpoint_shape(self, shard_id: str, stacked: bool) -> tuple[int, ...]:
        """The whole checkpoint tensor's shape: one expert's [I, H] (w1, w3) or [H, I] (w2), or the stacked
        [E, 2I, H] (w13) / [E, H, I] (w2) form."""
        inter, hidden = self.intermediate_size, self.hidden_size
        one = {"w1": (inter, hidden), "w3": (inter, hidden), "w2": (hidden, inter), "w13": (2 * inter, hidden)}
        return (self.num_experts, *one[shard_id]) if stacked else one[shard_id]

    def begin_packed_load(self) -> None:
        """Called by the loader for a quantized model: the expert kernels take dense weights only (so far)."""
        raise ValueError("quantization: quantized expert weights are not supported for mixture-of-experts "
                         "models yet; load an unquantized checkpoint with --quantization none (or unset)")

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x [T, H], router_logits [T, E] -> [T, H]."""
        weights, ids = ops.topk_softmax(router_logits, self.top_k, self.renormalize)
        out = ops.fused_moe(x, self.w13_weight, self.w2_weight, weights, ids)
        return self.tp.all_reduce(out) if self.reduce_results else out

    def checkpoint_names(self, prefix: str, names: tuple[str, str, str]) -> list[str]:
        """Per-expert checkpoint names under `prefix` (the experts module), parts named (gate, up, down)."""
        return [f"{prefix}.{e}.{part}.weight" for e in range(self.num_experts) for part in names]
