"""Paged attention layer: writes this step's K/V into the cache, then attends over the cache."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels.attention.backends import get_attn_backend
from pagedserve.kernels.attention.interface import AttentionBackend, AttentionImpl
from pagedserve.kernels.attention.metadata import AttentionMetadata


class PagedAttention(nn.Module):
    """Holds no weights. `kv_cache` is bound by the model runner after the cache is allocated:
    a tensor [2, num_blocks, num_kv_heads, block_size, head_dim] (index 0 = K, 1 = V). Binding it picks the
    layer's attention backend for the cache's device and dtype and makes the layer's impl, once
    (kernels/attention/backends.py); forward only calls it.

    sliding_window: this layer's window (None = global attention). Only the attention math applies it: the KV
    cache keeps every block of a sequence, also those that fell out of every layer's window, so a block is
    the same whichever layer reads it and prefix caching stays correct (simplest; costs memory on long
    sequences). logit_softcap: Gemma 2's tanh capping of the attention scores.

    k_scale / v_scale: an fp8 cache stores K / k_scale and V / v_scale (1.0 unless the checkpoint brings
    calibrated scales; the loader sets them). Python floats: fixed after load, so CUDA graphs bake them in.
    """

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float,
                 sliding_window: int | None = None, logit_softcap: float | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window: must be >= 1, got {sliding_window}")
        if logit_softcap is not None and logit_softcap <= 0:
            raise ValueError(f"attn_logit_softcapping: must be > 0, got {logit_softcap}")
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self._kv_cache: torch.Tensor | None = None
        self.impl: AttentionImpl | None = None
        self.k_scale = 1.0
        self.v_scale = 1.0

    @property
    def kv_cache(self) -> torch.Tensor | None:
        return self._kv_cache

    @kv_cache.setter
    def kv_cache(self, cache: torch.Tensor | None) -> None:
        self.bind_kv_cache(cache)

    def bind_kv_cache(self, cache: torch.Tensor | None, backend: type[AttentionBackend] | None = None) -> None:
        """Attend over `cache` from now on, with `backend` (None: the one for the cache's device and dtype)."""
        self._kv_cache, self.impl = cache, None
        if cache is None:
            return
        backend = backend or get_attn_backend(cache.device, cache.dtype)
        self.impl = backend.get_impl_cls()(self.num_heads, self.head_dim, self.num_kv_heads, self.scale,
                                           self.sliding_window, self.logit_softcap, cache.dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """q [T, num_heads*head_dim], k/v [T, num_kv_heads*head_dim] -> [T, num_heads*head_dim]."""
        if self.impl is None:
            raise RuntimeError("PagedAttention.kv_cache is not bound; the model runner allocates it")
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        out = self.impl.forward(self, q, k, v, self._kv_cache, meta)
        return out.reshape(-1, self.num_heads * self.head_dim)
