"""Kernel timing on a GPU and the two floors a kernel is held to: bytes / the measured copy bandwidth and
FLOPs / the measured bf16 matmul rate. Each time is the median of triton.testing.do_bench_cudagraph (graph
replays: device time without the host's launch cost); the floors come from a device-to-device copy and a bf16
matmul measured in the same run. Needs CUDA and triton."""
from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.testing

DT = torch.bfloat16


def bench_launched(fn: Callable[[], object]) -> float:
    """Median milliseconds including the host's launch cost (for ops that sync and cannot be captured)."""
    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def bench(fn: Callable[[], object]) -> float:
    """Median milliseconds of the kernel(s) alone: replays of a CUDA graph of fn, so that the host's
    launch cost (tens of microseconds for a Triton launch from Python) stays out of the number."""
    return triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median")


def ceilings() -> tuple[float, float]:
    """(bytes/s of a large D2D copy counting read + write, bf16 matmul FLOP/s) measured here."""
    src = torch.randn(1 << 28, device="cuda", dtype=DT)         # 512 MiB
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * src.element_size() / (bench(lambda: dst.copy_(src)) / 1e3)
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=DT), torch.randn(n, n, device="cuda", dtype=DT)
    flops = 2 * n ** 3 / (bench(lambda: a @ b) / 1e3)
    return bw, flops
