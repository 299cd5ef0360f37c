"""Skinny GEMM (Triton) for decode-sized batches: y[M, N] = x[M, K] @ w[N, K]^T (+ bias), M <= 16.

At one to a few rows a linear layer only streams its weight; cuBLAS's GEMM tiles reach ~45 % of the
copy bandwidth there (benchmarks/gpu_h100.md). This kernel gives every program a slice of BLOCK_N
output columns and streams the full K, many loads in flight. Whether it is used for a shape is
measured once per (M, N, K, dtype) against F.linear: it is only picked where it is faster.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

MAX_ROWS = 16


@triton.jit
def _skinny_gemm_kernel(x_ptr, w_ptr, b_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                        HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                        BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = tl.arange(0, BLOCK_M)
    ks = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    w_base = w_ptr + cols[None, :].to(tl.int64) * stride_wn
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        x = tl.load(x_ptr + rows[:, None] * stride_xm + k[None, :], mask=(rows[:, None] < M) & (k[None, :] < K),
                    other=0.0)
        w = tl.load(w_base + k[:, None], mask=(cols[None, :] < N) & (k[:, None] < K), other=0.0)
        if IEEE:
            acc += tl.dot(x, w, input_precision="ieee")
        else:
            acc += tl.dot(x, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=(rows[:, None] < M) & (cols[None, :] < N))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 16, K] (unit stride in K), weight [N, K] contiguous -> [M, N] in x's dtype."""
    rows, k = x.shape
    n = weight.shape[0]
    y = torch.empty(rows, n, dtype=x.dtype, device=x.device)
    block_n = 16 if n <= 4096 else 32 if n <= 16384 else 64
    _skinny_gemm_kernel[(triton.cdiv(n, block_n),)](
        x, weight, bias if bias is not None else weight, y, rows, n, k, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, BLOCK_M=MAX_ROWS, BLOCK_N=block_n, BLOCK_K=128,
        IEEE=x.dtype == torch.float32, num_warps=4, num_stages=4)
    return y


def _median_ms(fn, reps: int = 25) -> float:
    fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


class SkinnyGemmChooser:
    """Remembers, per (rows, N, K, dtype), whether the skinny kernel beat F.linear when first measured.

    Measuring synchronizes, so it never happens while a CUDA graph is being captured: an unmeasured
    shape then falls back to F.linear (graph capture warms every shape up eagerly first)."""

    def __init__(self) -> None:
        self.faster: dict[tuple, bool] = {}

    def use_skinny(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
        key = (x.shape[0], weight.shape[0], weight.shape[1], x.dtype)
        choice = self.faster.get(key)
        if choice is None:
            if torch.cuda.is_current_stream_capturing():
                return False
            ours = _median_ms(lambda: skinny_gemm(x, weight, bias))
            theirs = _median_ms(lambda: F.linear(x, weight, bias))
            choice = self.faster[key] = ours < theirs
        return choice
