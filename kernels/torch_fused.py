"""The fused elementwise ops in plain PyTorch (RMSNorm with residual, SiLU*mul, q/k norm + rotary): the path
on CPU, and the oracle for kernels/triton/fused.py."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with a residual (norm(x + residual) * weight, x + residual)."""
    if residual is None:
        return _rms_norm(x, weight, eps)
    x = x + residual
    return _rms_norm(x, weight, eps), x


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides) rotated, neox layout; cos/sin [T, 1, D] in x's dtype. Returns a new tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """qk [T, Hq + Hkv, D]: optional per-head RMSNorm (Qwen3), then rotary; cos/sin [T, 1, D]."""
    if q_weight is not None:
        qk = torch.cat((_rms_norm(qk[:, :num_q_heads], q_weight, eps),
                        _rms_norm(qk[:, num_q_heads:], k_weight, eps)), dim=1)
    return apply_rotary(qk, cos.view(cos.shape[0], 1, -1), sin.view(sin.shape[0], 1, -1))
