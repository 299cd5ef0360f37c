"""Rotary position embedding (neox / rotate-half layout): cos/sin tables for every position.

The scaling variants (linear, llama3, yarn, dynamic NTK, longrope) live in rope_scaling.py.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.common.model_files import rope_max_positions, rope_settings
from pagedserve.executor.model.layers.rope_scaling import scaled_inv_freq


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, kept in float32.

    One instance serves all layers: the model looks up cos/sin once per forward.
    """

    def __init__(self, head_dim: int, max_positions: int, inv_freq: torch.Tensor,
                 attention_factor: float = 1.0) -> None:
        super().__init__()
        self.head_dim = head_dim
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        # YaRN / longrope scale cos and sin (transformers' `attention_scaling`), in float32 like transformers.
        cos, sin = emb.cos(), emb.sin()
        if attention_factor != 1.0:
            cos, sin = cos * attention_factor, sin * attention_factor
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, 1, D], [T, 1, D]) for positions [T], cast to dtype as transformers does."""
        cos = self.cos_cache.index_select(0, positions).to(dtype)
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def get_rope(hf_config: Any, head_dim: int, max_model_len: int | None = None) -> RotaryEmbedding:
    """The model's rotary embedding. max_model_len (default: the longest the config allows) only matters for
    longrope, which picks its short or long factors from it (see rope_scaling.longrope)."""
    theta, scaling = rope_settings(hf_config)
    partial = float((scaling or {}).get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"rope_scaling: partial_rotary_factor={partial} is not supported")
    positions = rope_max_positions(hf_config)
    inv_freq, attention_factor = scaled_inv_freq(head_dim, theta, scaling, hf_config, max_model_len or positions)
    return RotaryEmbedding(head_dim, positions, inv_freq, attention_factor)
