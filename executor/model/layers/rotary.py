"""Rotary position embedding (neox / rotate-half layout) with default, linear and llama3 scaling."""
from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from pagedserve.common.model_files import rope_settings


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Same arithmetic, in the same order, as transformers' _compute_llama3_parameters.
    factor = float(scaling["factor"])
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """float32 [head_dim // 2] inverse frequencies after scaling."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (theta ** exponents)
    kind = "default" if not scaling else scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """cos/sin tables for every position up to max_positions, kept in float32.

    One instance serves all layers: the model looks up cos/sin once per forward.
    """

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        inv_freq = inverse_frequencies(head_dim, theta, scaling)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos_cache", emb.cos(), persistent=False)
        self.register_buffer("sin_cache", emb.sin(), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """([T, 1, D], [T, 1, D]) for positions [T], cast to dtype as transformers does."""
        cos = self.cos_cache.index_select(0, positions).to(dtype)
        sin = self.sin_cache.index_select(0, positions).to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def get_rope(hf_config: Any, head_dim: int) -> RotaryEmbedding:
    theta, scaling = rope_settings(hf_config)
    partial = float((scaling or {}).get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ValueError(f"rope_scaling: partial_rotary_factor={partial} is not supported")
    return RotaryEmbedding(head_dim, int(hf_config.max_position_embeddings), theta, scaling)
