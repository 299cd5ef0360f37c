"""Fused element-wise kernels (Triton) where eager PyTorch launches several kernels per layer:
RMSNorm with the residual add, SiLU(gate)*up, and per-head q/k RMSNorm + rotary embedding.

Each computes in float32 and rounds once; the PyTorch layers are the CPU path and the oracle.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr, eps, stride_x, stride_r, stride_o,
                     N: tl.constexpr, BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RES:
        # The residual stream is kept in the model dtype, as the eager path keeps it.
        x = (x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)).to(x_ptr.dtype.element_ty)
        tl.store(res_out_ptr + row * N + cols, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * rstd).to(x_ptr.dtype.element_ty)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_o + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with a residual (norm(x + residual) * weight, x + residual). x [T, N]."""
    rows, n = x.shape
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(out) if residual is not None else out
    if rows:
        _rms_norm_kernel[(rows,)](x, residual if residual is not None else x, out, res_out, weight, eps,
                                  x.stride(0), residual.stride(0) if residual is not None else 0, out.stride(0),
                                  N=n, BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None,
                                  num_warps=4 if n <= 4096 else 8)
    return out if residual is None else (out, res_out)


@triton.jit
def _silu_and_mul_kernel(x_ptr, out_ptr, stride_x, N: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + N + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(out_ptr + row * N + cols, out.to(out_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2d] = [gate | up] -> silu(gate) * up [T, d]."""
    rows, width = x.shape
    n = width // 2
    out = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    if rows:
        _silu_and_mul_kernel[(rows, triton.cdiv(n, block))](x, out, x.stride(0), N=n, BLOCK=block)
    return out


@triton.jit
def _qk_norm_rope_kernel(qk_ptr, out_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps, stride_t, stride_cs,
                         NUM_Q_HEADS: tl.constexpr, NUM_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr,
                         HALF: tl.constexpr, HAS_NORM: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HALF)
    mask = (heads < NUM_HEADS)[:, None]
    base = qk_ptr + token * stride_t + heads[:, None] * (2 * HALF) + dims[None, :]
    lo = tl.load(base, mask=mask, other=0.0)
    hi = tl.load(base + HALF, mask=mask, other=0.0)
    dtype = lo.dtype
    if HAS_NORM:
        # Qwen3: RMSNorm over each head before rope, q heads with q_norm's weight, k heads with k_norm's.
        lf, hf = lo.to(tl.float32), hi.to(tl.float32)
        rstd = 1.0 / tl.sqrt((tl.sum(lf * lf, 1) + tl.sum(hf * hf, 1)) / (2 * HALF) + eps)
        is_q = (heads < NUM_Q_HEADS)[:, None]
        w_lo = tl.where(is_q, tl.load(qw_ptr + dims)[None, :], tl.load(kw_ptr + dims)[None, :])
        w_hi = tl.where(is_q, tl.load(qw_ptr + HALF + dims)[None, :], tl.load(kw_ptr + HALF + dims)[None, :])
        lo = w_lo * (lf * rstd[:, None]).to(dtype)
        hi = w_hi * (hf * rstd[:, None]).to(dtype)
    cos = tl.load(cos_ptr + token * stride_cs + dims)[None, :].to(tl.float32)
    sin = tl.load(sin_ptr + token * stride_cs + dims)[None, :].to(tl.float32)
    lf, hf = lo.to(tl.float32), hi.to(tl.float32)
    out = out_ptr + token * (NUM_HEADS * 2 * HALF) + heads[:, None] * (2 * HALF) + dims[None, :]
    tl.store(out, (lf * cos - hf * sin).to(dtype), mask=mask)
    tl.store(out + HALF, (hf * cos + lf * sin).to(dtype), mask=mask)


def qk_norm_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """qk [T, Hq + Hkv, D] (unit stride within a token) -> contiguous rotated copy, neox layout.

    cos/sin [T, D] (or [T, 1, D]); their halves repeat, so only the first D/2 are read.
    With q_weight/k_weight, each head is RMS-normalised first (Qwen3).
    """
    tokens, heads, dim = qk.shape
    out = torch.empty(tokens, heads, dim, dtype=qk.dtype, device=qk.device)
    has_norm = q_weight is not None
    if tokens:
        _qk_norm_rope_kernel[(tokens,)](
            qk, out, cos, sin, q_weight if has_norm else cos, k_weight if has_norm else cos, eps,
            qk.stride(0), cos.stride(0), NUM_Q_HEADS=num_q_heads, NUM_HEADS=heads,
            HEADS_PAD=triton.next_power_of_2(heads), HALF=dim // 2, HAS_NORM=has_norm)
    return out
