"""Encoder self-attention (BERT family): bidirectional, with no KV cache. The backend for the device is
picked as for paged attention (kernels/attention/backends.py); its impl's forward_encoder attends."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.attention.backends import get_attn_backend
from pagedserve.kernels.attention.interface import AttentionImpl
from pagedserve.kernels.attention.metadata import AttentionMetadata


class EncoderAttention(nn.Module):
    """Holds no weights and no cache; meta tells where each sequence's tokens are (query_start_loc_cpu), and
    every sequence's whole prompt is in the step (the scheduler never chunks an encoder's prompt)."""

    def __init__(self, num_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.scale = num_heads, head_dim, scale
        self._impl: AttentionImpl | None = None

    def _get_impl(self, device: torch.device, dtype: torch.dtype) -> AttentionImpl:
        if self._impl is None:
            backend = get_attn_backend(device, dtype)
            self._impl = backend.get_impl_cls()(self.num_heads, self.head_dim, self.num_heads, self.scale,
                                                None, None, dtype)
        return self._impl

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """q, k, v [T, num_heads * head_dim] -> [T, num_heads * head_dim]."""
        shape = (-1, self.num_heads, self.head_dim)
        out = self._get_impl(q.device, q.dtype).forward_encoder(q.view(shape), k.view(shape), v.view(shape), meta)
        return out.reshape(-1, self.num_heads * self.head_dim)
