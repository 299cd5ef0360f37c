"""Mixtral (MixtralForCausalLM): Llama's attention with a sparse expert block in every layer.

The router picks the top `num_experts_per_tok` of `num_local_experts` by softmax and renormalises their
weights to sum to 1. Checkpoints name the block `block_sparse_moe` and each expert's tensors w1 (gate),
w3 (up) and w2 (down).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.layers.fused_moe import FusedMoE, Router
from pagedserve.executor.model.models.moe_base import MoeForCausalLM
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup


def check_silu(hf_config: Any, arch: str) -> None:
    act = getattr(hf_config, "hidden_act", "silu")
    if act != "silu":
        raise ValueError(f"hidden_act: {act!r} is not supported for {arch} (only 'silu')")


class MixtralSparseMoe(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        self.gate = Router(cfg.hidden_size, cfg.num_local_experts)
        self.experts = FusedMoE(cfg.num_local_experts, cfg.num_experts_per_tok, cfg.hidden_size,
                                cfg.intermediate_size, renormalize=True, tp=tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.experts(h, self.gate(h))


class MixtralForCausalLM(MoeForCausalLM):
    expert_parts = ("w1", "w3", "w2")
    checkpoint_block = "block_sparse_moe"

    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        check_silu(hf_config, "MixtralForCausalLM")
        super().__init__(hf_config, tp, pp)

    @classmethod
    def attention_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return False, False

    def make_mlp(self, hf_config: Any, tp: TPGroup, layer: int) -> nn.Module:
        return MixtralSparseMoe(hf_config, tp)
