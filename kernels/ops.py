"""One entry point per op: the model calls these and gets the best implementation for its device."""
from __future__ import annotations

import torch

from pagedserve.kernels import reference
from pagedserve.kernels.metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    return reference.paged_attention(query, k_cache, v_cache, meta, scale)
