"""What an attention backend is (vLLM's AttentionBackend / AttentionImpl / metadata-builder shapes, smaller).

A backend is picked once per device and KV-cache dtype (kernels/attention/backends.py:get_attn_backend):
- its AttentionImpl, one per attention layer, made when the layer's KV cache is bound, writes a step's keys
  and values into the cache and attends over it;
- its AttentionMetadataBuilder, one per model runner, turns each step's batch into the AttentionMetadata
  that every layer of that step reads.

The contract every backend keeps (tests/test_attention_backends.py holds them all to dense attention):
query tokens of a sequence sit at the end of its context and attend causally, also among themselves, so a
"decode" of several tokens (speculative decoding verifying a draft, meta.decode_query_len > 1) is served
like any other sequence, natively or through the backend's chunk path.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Protocol

import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata


class ScaledLayer(Protocol):
    """What an impl reads from its layer on every call: the fp8 cache's scales, set by the loader after the
    impl is made (1.0 unless the checkpoint brings calibrated ones; a float cache ignores them)."""
    k_scale: float
    v_scale: float


class AttentionImpl(ABC):
    """One layer's attention: fixed shapes and options, no per-call choice of kernel."""

    def __init__(self, num_heads: int, head_dim: int, num_kv_heads: int, scale: float,
                 sliding_window: int | None, logit_softcap: float | None, kv_cache_dtype: torch.dtype) -> None:
        self.num_heads, self.head_dim, self.num_kv_heads, self.scale = num_heads, head_dim, num_kv_heads, scale
        self.sliding_window, self.logit_softcap = sliding_window, logit_softcap
        self.kv_cache_dtype = kv_cache_dtype

    @abstractmethod
    def forward(self, layer: ScaledLayer, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                kv_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Write key/value [T, Hkv, D] at meta.slot_mapping (slot -1: not written) into kv_cache
        [2, num_blocks, Hkv, block_size, D], then attend: query [T, Hq, D] -> [T, Hq, D]."""

    def forward_encoder(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        """Encoder-only attention (BERT): no KV cache is written or read, and every token of a sequence sees
        all of that sequence's tokens of this step (not causal); query [T, Hq, D] -> [T, Hq, D]. The SDPA
        path serves every backend (CPU and CUDA); a backend with a faster varlen kernel overrides it."""
        from pagedserve.kernels.attention.reference import encoder_attention
        return encoder_attention(query, key, value, meta, self.scale)


class AttentionMetadataBuilder:
    """Builds one step's AttentionMetadata from the runner's step tensors (device) and host copies.

    Decodes come first (the runner orders them), each with decode_query_len tokens. A backend that wants
    more per step (precomputed plans, split counts) subclasses this; the ones here need nothing more, since
    the CPU path memoizes its per-step plans itself (kernels/attention/cpu_paged.py: StepPlan)."""

    def __init__(self, backend: type[AttentionBackend]) -> None:
        self.backend = backend

    def build(self, *, slot_mapping: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
              block_tables: torch.Tensor, num_decodes: int, max_query_len: int, max_seq_len: int,
              query_start_loc_cpu: list[int], seq_lens_cpu: list[int],
              decode_query_len: int = 1) -> AttentionMetadata:
        if decode_query_len < 1:
            raise ValueError(f"decode_query_len must be >= 1, got {decode_query_len}")
        return AttentionMetadata(slot_mapping=slot_mapping, query_start_loc=query_start_loc, seq_lens=seq_lens,
                                 block_tables=block_tables, num_decodes=num_decodes, max_query_len=max_query_len,
                                 max_seq_len=max_seq_len, query_start_loc_cpu=query_start_loc_cpu,
                                 seq_lens_cpu=seq_lens_cpu, decode_query_len=decode_query_len)


class AttentionBackend(ABC):
    name: ClassVar[str]

    @staticmethod
    @abstractmethod
    def get_impl_cls() -> type[AttentionImpl]: ...

    @staticmethod
    def get_builder_cls() -> type[AttentionMetadataBuilder]:
        return AttentionMetadataBuilder
