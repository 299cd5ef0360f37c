"""The Triton kernel tests' device and error measure, and one paged-attention run through both the Triton
kernel and the PyTorch reference (shared by the CPU-interpreter tests and the GPU tests).

The caller sets TRITON_INTERPRET before importing this on CPU: @triton.jit reads it at decoration time,
so the Triton modules are imported only when a kernel runs."""
from __future__ import annotations

import math

import torch

from pagedserve.kernels.attention import reference as attention_reference
from pagedserve.kernels.attention.metadata import AttentionMetadata
from pagedserve.tests.helpers.kernels.attention_cases import make_batch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any()
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def to_device(meta: AttentionMetadata) -> AttentionMetadata:
    return AttentionMetadata(**{name: value.to(DEVICE) if isinstance(value, torch.Tensor) else value
                                for name, value in vars(meta).items()})


def run_both(seqs, block_size, hq, hkv, d, seed, num_splits=None, share_prefix=0, dtype=torch.float32,
             window=None, softcap=None):
    from pagedserve.kernels.attention import triton_paged as triton_attention
    gen = torch.Generator().manual_seed(seed)
    k_cache, v_cache, _, meta = make_batch(seqs, block_size, hkv, d, gen, dtype, share_prefix)
    # Query as a strided view into a wider buffer, the way the model hands it over (a slice of qkv).
    wide = torch.randn(meta.query_start_loc_cpu[-1], hq + 2, d, generator=gen).to(dtype)
    q = wide[:, :hq]
    scale = 1 / math.sqrt(d)
    ref = attention_reference.paged_attention(q.float(), k_cache.float(), v_cache.float(), meta, scale, window, softcap)
    out = triton_attention.paged_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), to_device(meta),
                                           scale, num_splits=num_splits, window=window, softcap=softcap)
    return out.float().cpu(), ref
