"""PyTorch ops: the CPU path and the oracle for the Triton kernels (paged attention, cache write,
RMSNorm, SiLU*mul, q/k norm + rotary). Paged attention and the cache write live in cpu_attention.

Cache layout: [num_blocks, num_kv_heads, block_size, head_dim] per K and V.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_attention
from pagedserve.kernels.metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into the caches at slot_mapping (block * block_size + offset; -1 skipped)."""
    cpu_attention.write_kv_cache(key, value, k_cache, v_cache, cpu_attention.write_plan(slot_mapping, k_cache))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each sequence's paged context; returns [T, Hq, D]."""
    kv_rows = cpu_attention.stacked_rows(k_cache, v_cache)
    plan = cpu_attention.step_plan(meta, k_cache, query.shape[1], kv_rows is not None)
    return cpu_attention.paged_attention(query, k_cache, v_cache, kv_rows, plan, scale)


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


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 signed_sin: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, H, D] (any strides) rotated, neox layout; cos/sin [T, 1, D] in x's dtype. Returns a new tensor.

    signed_sin (sin with its first half negated, see `signed_sin`) saves the negation: rotate_half(x) * sin
    is then roll(x, D/2) * signed_sin, the same products bit for bit, in two ops instead of four."""
    if signed_sin is None:
        signed_sin = _negate_first_half(sin)
    return x * cos + x.roll(x.shape[-1] // 2, -1) * signed_sin


_signed_sins = cpu_attention.LastStep()


def signed_sin(sin: torch.Tensor) -> torch.Tensor:
    """cat(-sin[..., :D/2], sin[..., D/2:]), made once per forward pass: every layer passes the same sin."""
    return _signed_sins.get(sin, (cpu_attention.version(sin),), (), _negate_first_half)


def _negate_first_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., :half], x[..., half:]), dim=-1)


def qk_norm_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """qk [T, Hq + Hkv, D]: optional per-head RMSNorm (Qwen3), then rotary; cos/sin [T, 1, D]."""
    if q_weight is not None:
        qk = torch.cat((_rms_norm(qk[:, :num_q_heads], q_weight, eps),
                        _rms_norm(qk[:, num_q_heads:], k_weight, eps)), dim=1)
    sin_signed = signed_sin(sin).view(sin.shape[0], 1, -1)
    return apply_rotary(qk, cos.view(cos.shape[0], 1, -1), sin.view(sin.shape[0], 1, -1), sin_signed)
