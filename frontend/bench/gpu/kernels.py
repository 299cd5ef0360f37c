"""`pagedserve bench kernels`: GPU kernel timings against the two floors: bytes / measured bandwidth and FLOPs /
measured matmul rate.

    pagedserve bench kernels --out benchmarks/kernels_gpu.md
    pagedserve bench kernels --moe --out benchmarks/moe_kernel_gpu.md

Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head_dim 128), bf16, block size 16 (dense.py);
with --moe, OLMoE-1B-7B's expert layer (hidden 2048, 64 experts of intermediate 1024, top 8), bf16, random routing,
checked against the grouped PyTorch reference first (moe.py). Each time is the median of
triton.testing.do_bench_cudagraph (graph replays: device time without the host's launch cost); the floors come
from a device-to-device copy and a bf16 matmul measured in the same run. Inputs are random (never zeros) and
rotate over several sets larger than L2 where it matters. Needs a CUDA GPU and triton.
"""
from __future__ import annotations

import argparse
import importlib.util


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--moe", action="store_true", help="the fused-MoE kernel instead of attention, the fused "
                                                           "elementwise kernels and the skinny GEMM")
    parser.add_argument("--out", default=None, help="append the markdown table to this file")


def require_gpu() -> None:
    """SystemExit saying what is missing: checked before any GPU module is imported, so a CPU machine gets a
    sentence, not a CUDA error from deep inside a kernel."""
    import torch
    if not torch.cuda.is_available():
        raise SystemExit("pagedserve bench kernels needs a CUDA GPU (torch.cuda.is_available() is False here)")
    if importlib.util.find_spec("triton") is None:
        raise SystemExit("pagedserve bench kernels needs triton: pip install 'pagedserve[gpu]'")


def main(args: argparse.Namespace) -> None:
    require_gpu()
    from pagedserve.frontend.bench.gpu import timing
    bw, flops = timing.ceilings()
    if args.moe:
        from pagedserve.frontend.bench.gpu import moe
        text, tail = moe.table(bw, flops), "\n"
    else:
        from pagedserve.frontend.bench.gpu import dense
        text, tail = dense.table(bw, flops), "\n\n"      # each table as the scripts appended it
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + tail)
