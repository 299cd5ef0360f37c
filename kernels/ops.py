"""One entry point per op: the model calls these and gets Triton on CUDA, the PyTorch reference elsewhere.

`PAGEDSERVE_KERNELS=torch` forces the reference on CUDA too (for A/B checks against the kernels).
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pagedserve.common import envs
from pagedserve.kernels import moe_reference, reference
from pagedserve.kernels.metadata import AttentionMetadata


@functools.cache
def _triton_usable() -> bool:
    if envs.PAGEDSERVE_KERNELS == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and _triton_usable()


@functools.cache
def _skinny_chooser():
    # One memo per process, like Triton's own autotuning cache: the choice depends only on the shape
    # and the device.
    from pagedserve.kernels.triton_gemm import SkinnyGemmChooser
    return SkinnyGemmChooser()


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x @ weight.T + bias; decode-sized batches on CUDA may take the skinny Triton GEMM where it is faster."""
    if use_triton(x) and x.dim() == 2 and x.shape[0] <= 16 and x.stride(-1) == 1 and weight.is_contiguous():
        from pagedserve.kernels import triton_gemm
        if _skinny_chooser().use_skinny(x, weight, bias):
            return triton_gemm.skinny_gemm(x, weight, bias)
    return F.linear(x, weight, bias)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """k_scale / v_scale: what an fp8 cache divides by before storing (other caches ignore them)."""
    if use_triton(key):
        from pagedserve.kernels import triton_cache
        triton_cache.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)
    else:
        reference.write_kv_cache(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """window: keys at positions > query position - window only (None: global); softcap: tanh capping;
    k_scale / v_scale: an fp8 cache's scales (codes * scale are the values)."""
    if use_triton(query):
        from pagedserve.kernels import triton_attention
        return triton_attention.paged_attention(query, k_cache, v_cache, meta, scale, window=window,
                                                softcap=softcap, k_scale=k_scale, v_scale=v_scale)
    return reference.paged_attention(query, k_cache, v_cache, meta, scale, window, softcap, k_scale, v_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with a residual (norm(x + residual) * weight, x + residual)."""
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        from pagedserve.kernels import triton_fused
        return triton_fused.rms_norm(x, weight, eps, residual)
    return reference.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        from pagedserve.kernels import triton_fused
        return triton_fused.silu_and_mul(x)
    return reference.silu_and_mul(x)


def qk_norm_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """qk [T, Hq + Hkv, D]: optional per-head RMSNorm (q heads, then k heads), then rotary."""
    dim = qk.shape[-1]
    if use_triton(qk) and qk.stride(-1) == 1 and dim % 2 == 0 and dim & (dim - 1) == 0:
        from pagedserve.kernels import triton_fused
        return triton_fused.qk_norm_rope(qk, cos, sin, num_q_heads, q_weight, k_weight, eps)
    return reference.qk_norm_rope(qk, cos, sin, num_q_heads, q_weight, k_weight, eps)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: (weights [T, k] float32, expert ids [T, k]) from logits [T, E]."""
    return moe_reference.topk_softmax(router_logits, top_k, renormalize)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's chosen experts (SiLU-gated MLPs, stacked weights); x [T, H] -> [T, H]."""
    if use_triton(x) and x.dim() == 2:
        from pagedserve.kernels import triton_moe
        return triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    return moe_reference.fused_moe(x, w13, w2, topk_weights, topk_ids)
