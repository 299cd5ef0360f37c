"""The fused elementwise ops and the MoE experts, one entry point each: Triton on CUDA, PyTorch elsewhere.

Linears and attention are not here: a linear layer's method (executor/model/layers/linear_method.py) and an
attention layer's backend (kernels/attention/backends.py) are picked once, at load. These ops are cheap to
route (one device test) and shared by every model family, so they route per call.
`PAGEDSERVE_KERNELS=torch` forces PyTorch on CUDA too (for A/B checks against the kernels).
"""
from __future__ import annotations

import functools

import torch

from pagedserve.common import envs
from pagedserve.kernels import torch_moe, torch_fused


@functools.cache
def triton_usable() -> bool:
    """Whether CUDA tensors take the Triton kernels in this process (asked once)."""
    if envs.PAGEDSERVE_KERNELS == "torch":
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def use_triton(x: torch.Tensor) -> bool:
    return x.is_cuda and triton_usable()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with a residual (norm(x + residual) * weight, x + residual)."""
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        from pagedserve.kernels.triton import fused as triton_fused
        return triton_fused.rms_norm(x, weight, eps, residual)
    return torch_fused.rms_norm(x, weight, eps, residual)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    if use_triton(x) and x.dim() == 2 and x.stride(-1) == 1:
        from pagedserve.kernels.triton import fused as triton_fused
        return triton_fused.silu_and_mul(x)
    return torch_fused.silu_and_mul(x)


def qk_norm_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """qk [T, Hq + Hkv, D]: optional per-head RMSNorm (q heads, then k heads), then rotary."""
    dim = qk.shape[-1]
    if use_triton(qk) and qk.stride(-1) == 1 and dim % 2 == 0 and dim & (dim - 1) == 0:
        from pagedserve.kernels.triton import fused as triton_fused
        return triton_fused.qk_norm_rope(qk, cos, sin, num_q_heads, q_weight, k_weight, eps)
    return torch_fused.qk_norm_rope(qk, cos, sin, num_q_heads, q_weight, k_weight, eps)


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Router: (weights [T, k] float32, expert ids [T, k]) from logits [T, E]."""
    return torch_moe.topk_softmax(router_logits, top_k, renormalize)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """Weighted sum of each token's chosen experts (SiLU-gated MLPs, stacked weights); x [T, H] -> [T, H]."""
    if use_triton(x) and x.dim() == 2:
        from pagedserve.kernels.triton import moe as triton_moe
        return triton_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
    return torch_moe.fused_moe(x, w13, w2, topk_weights, topk_ids)
