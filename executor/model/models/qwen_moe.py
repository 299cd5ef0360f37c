"""Qwen2-MoE and Qwen3-MoE: Qwen2 / Qwen3 attention with sparse expert blocks.

Router: softmax over `num_experts`, top `num_experts_per_tok`; the k weights are renormalised only with
`norm_topk_prob` (false for Qwen1.5/2-MoE, true for Qwen3-MoE). Qwen2-MoE adds a shared expert, a dense MLP
every token takes, scaled by sigmoid(shared_expert_gate(x)). Layers listed in `mlp_only_layers`, or not on
the `decoder_sparse_step` stride, keep a dense MLP of `intermediate_size`.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.layers.activation import SiluAndMul
from pagedserve.executor.model.layers.fused_moe import FusedMoE, Router
from pagedserve.executor.model.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from pagedserve.executor.model.models.mixtral import check_silu
from pagedserve.executor.model.models.moe_base import MoeForCausalLM
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup


class SharedExpertMLP(nn.Module):
    """A dense SiLU MLP returning this rank's partial sum (the sparse block reduces once for both)."""

    def __init__(self, hidden_size: int, intermediate_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, False, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, False, tp, reduce_results=False)
        self.act_fn = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(h)))


class QwenSparseMoe(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        shared = getattr(cfg, "shared_expert_intermediate_size", 0) or 0
        self.gate = Router(cfg.hidden_size, cfg.num_experts)
        self.experts = FusedMoE(cfg.num_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.moe_intermediate_size, renormalize=bool(getattr(cfg, "norm_topk_prob", False)),
                                tp=tp, reduce_results=False)
        self.shared_expert = SharedExpertMLP(cfg.hidden_size, shared, tp) if shared else None
        self.shared_expert_gate = Router(cfg.hidden_size, 1) if shared else None

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        out = self.experts(h, self.gate(h))
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(h)) * self.shared_expert(h)
        return self.tp.all_reduce(out)


def is_sparse_layer(cfg: Any, layer: int) -> bool:
    step = getattr(cfg, "decoder_sparse_step", 1) or 1
    return (layer not in (getattr(cfg, "mlp_only_layers", None) or []) and cfg.num_experts > 0
            and (layer + 1) % step == 0)


class Qwen2MoeForCausalLM(MoeForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        check_silu(hf_config, type(self).__name__)
        super().__init__(hf_config, tp, pp)

    @classmethod
    def attention_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return bool(getattr(hf_config, "qkv_bias", True)), False

    def make_mlp(self, hf_config: Any, tp: TPGroup, layer: int) -> nn.Module | None:
        return QwenSparseMoe(hf_config, tp) if is_sparse_layer(hf_config, layer) else None


class Qwen3MoeForCausalLM(Qwen2MoeForCausalLM):
    qk_norm = True

    @classmethod
    def attention_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias
