"""Rotary position embedding (neox / rotate-half layout): cos/sin tables for every position.

The scaling variants (linear, llama3, yarn, dynamic NTK, longrope) live in rope_scaling.py.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch
from torch import nn

from pagedserve.common.model.model_files import rope_max_positions, rope_settings
from pagedserve.executor.model.layers.rope_scaling import scaled_inv_freq


# The engine's max_model_len while the loader builds a model: longrope picks its factors by it, and the model
# classes keep their (hf_config, tp) constructors.
_MAX_MODEL_LEN: ContextVar[int | None] = ContextVar("rope_max_model_len", default=None)


@contextmanager
def engine_max_model_len(max_model_len: int) -> Iterator[None]:
    token = _MAX_MODEL_LEN.set(max_model_len)
    try:
        yield
    finally:
        _MAX_MODEL_LEN.reset(token)


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
    """The model's rotary embedding. max_model_len (default: the engine's, under engine_max_model_len, else the
    longest the config allows) only matters for longrope: it picks the short or long factors (rope_scaling)."""
    theta, scaling = rope_settings(hf_config)
    partial = float((scaling or {}).get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 1.0)))
    if partial != 1.0:
        raise ValueError(f"rope_scaling: partial_rotary_factor={partial} is not supported")
    positions = rope_max_positions(hf_config)
    max_model_len = max_model_len or _MAX_MODEL_LEN.get() or positions
    inv_freq, attention_factor = scaled_inv_freq(head_dim, theta, scaling, hf_config, max_model_len)
    return RotaryEmbedding(head_dim, positions, inv_freq, attention_factor)
