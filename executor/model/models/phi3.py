"""Phi-3 / Phi-3.5 (Phi3ForCausalLM): the Llama layout with fused qkv_proj and gate_up_proj in the checkpoint.

The fused tensors are cut into their q/k/v and gate/up parts and handed to our merged layers shard by shard,
so each tensor-parallel rank takes its own heads and intermediate rows exactly as for Llama's separate
tensors. Long-context variants use longrope scaling (layers/rope_scaling.py).
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from pagedserve.executor.model.models.llama import LlamaForCausalLM
from pagedserve.executor.model.parallel_state import TPGroup

# our parameter-name parts a fused checkpoint tensor is split into
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
_PART_TO_FUSED = {part: fused for fused, parts in _FUSED_PARTS.items() for part in parts}


class Phi3ForCausalLM(LlamaForCausalLM):
    def __init__(self, hf_config: Any, tp: TPGroup) -> None:
        act = getattr(hf_config, "hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"hidden_act: {act!r} is not supported for Phi3ForCausalLM (only 'silu')")
        super().__init__(hf_config, tp)

    @classmethod
    def attention_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return False, False

    def stream_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Split fused tensors, load them as Llama's parts; report the checkpoint's own (fused) names."""
        loaded = super().stream_weights(self._split_fused(weights))
        return {_fused_name(name) for name in loaded}

    def expected_weights(self) -> set[str]:
        return {_fused_name(name) for name in super().expected_weights()}

    def _split_fused(self, weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        cfg = self.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        sizes = {"qkv_proj": [cfg.num_attention_heads * head_dim, kv_heads * head_dim, kv_heads * head_dim],
                 "gate_up_proj": [cfg.intermediate_size, cfg.intermediate_size]}
        for name, tensor in weights:
            prefix, _, leaf = name.rpartition(".")
            module_path, _, proj = prefix.rpartition(".")
            if proj not in _FUSED_PARTS:
                yield name, tensor
                continue
            if tensor.shape[0] != sum(sizes[proj]):
                raise ValueError(f"checkpoint tensor {name!r} has {tensor.shape[0]} rows, expected "
                                 f"{sum(sizes[proj])} ({' + '.join(map(str, sizes[proj]))})")
            for part, piece in zip(_FUSED_PARTS[proj], tensor.split(sizes[proj], dim=0)):
                yield f"{module_path}.{part}.{leaf}", piece


def _fused_name(name: str) -> str:
    """model.layers.0.self_attn.q_proj.weight -> model.layers.0.self_attn.qkv_proj.weight (others unchanged)."""
    prefix, _, leaf = name.rpartition(".")
    module_path, _, proj = prefix.rpartition(".")
    fused = _PART_TO_FUSED.get(proj)
    return f"{module_path}.{fused}.{leaf}" if fused else name
