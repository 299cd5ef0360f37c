"""`pagedserve bench kernels --moe`: the fused-MoE Triton kernel (kernels/triton/moe.py) on a GPU against its
bandwidth and FLOP floors.

    pagedserve bench kernels --moe --out benchmarks/moe_kernel_gpu.md

Shape: OLMoE-1B-7B's expert layer (hidden 2048, 64 experts of intermediate 1024, top 8), bf16, random routing.
Floors: bytes the step must move (the weights of every expert some token chose, read once, plus activations
in and out) / the measured copy bandwidth, and 2 * T * k * 3 * H * I FLOPs / the measured bf16 matmul rate
(timing.ceilings). Times: median of CUDA-graph replays (routing included: alignment is on the device);
the grouped PyTorch reference syncs for its per-expert split, so it is timed with launches.
"""
from __future__ import annotations

import torch

from pagedserve.frontend.bench.gpu.timing import DT, bench, bench_launched
from pagedserve.kernels import torch_moe
from pagedserve.kernels.triton import moe as triton_moe

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1024, 64, 8


def moe_inputs(tokens: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=DT, generator=gen)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, device="cuda", dtype=DT, generator=gen) / HIDDEN ** 0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, device="cuda", dtype=DT, generator=gen) / INTER ** 0.5
    logits = torch.randn(tokens, EXPERTS, device="cuda", generator=gen)
    weights, ids = torch_moe.topk_softmax(logits, TOP_K, renormalize=False)
    return x, w13, w2, weights, ids


def floor_bytes(tokens: int, ids: torch.Tensor) -> int:
    experts_used = int(torch.unique(ids).numel())
    weights = experts_used * 3 * HIDDEN * INTER * 2
    # x in, gate_up out + in, act out + in, down out + in, output out (bf16)
    activations = (tokens * HIDDEN + 2 * tokens * TOP_K * 2 * INTER + 2 * tokens * TOP_K * INTER
                   + 2 * tokens * TOP_K * HIDDEN + tokens * HIDDEN) * 2
    return weights + activations


def rows(bw: float, flops: float) -> list[tuple[str, float, float, float]]:
    out = []
    for tokens in (1, 8, 64, 256, 1024, 4096):
        x, w13, w2, weights, ids = moe_inputs(tokens)
        ref = torch_moe.fused_moe(x.float(), w13.float(), w2.float(), weights, ids)
        got = triton_moe.fused_moe(x, w13, w2, weights, ids).float()
        err = ((got - ref).norm() / ref.norm()).item()
        if err > 2e-2:
            raise RuntimeError(f"T={tokens}: Triton fused MoE differs from the reference (rel err {err:.3g})")
        work = 2 * tokens * TOP_K * 3 * HIDDEN * INTER
        floors = (floor_bytes(tokens, ids) / bw * 1e3, work / flops * 1e3)
        out.append((f"fused MoE T={tokens} (Triton)", bench(lambda: triton_moe.fused_moe(x, w13, w2, weights, ids)),
                    *floors))
        if tokens <= 1024:
            out.append(("  grouped PyTorch reference (syncs: timed with launches)",
                        bench_launched(lambda: torch_moe.fused_moe(x, w13, w2, weights, ids)), *floors))
    return out


def table(bw: float, flops: float) -> str:
    """Every MoE row as one markdown table under a heading naming the shape, the device and the ceilings."""
    lines = [f"\n### Fused MoE, OLMoE-1B-7B expert layer (H {HIDDEN}, I {INTER}, {EXPERTS} experts, top {TOP_K}), "
             f"bf16, {torch.cuda.get_device_name()}",
             f"measured: copy {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", "",
             "| case | ms | bandwidth floor ms | FLOP floor ms | x max(floor) |", "|---|---:|---:|---:|---:|"]
    for name, ms, bw_ms, fl_ms in rows(bw, flops):
        lines.append(f"| {name} | {ms:.4f} | {bw_ms:.4f} | {fl_ms:.4f} | {ms / max(bw_ms, fl_ms):.2f} |")
    return "\n".join(lines)
