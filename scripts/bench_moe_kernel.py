"""The fused-MoE Triton kernel (kernels/triton/moe.py) on a GPU against its bandwidth and FLOP floors.

    python scripts/bench_moe_kernel.py --out benchmarks/moe_kernel_gpu.md

Shape: OLMoE-1B-7B's expert layer (hidden 2048, 64 experts of intermediate 1024, top 8), bf16, random routing.
Floors: bytes the step must move (the weights of every expert some token chose, read once, plus activations
in and out) / the measured copy bandwidth, and 2 * T * k * 3 * H * I FLOPs / the measured bf16 matmul rate
(bench_kernels.ceilings). Times: median of CUDA-graph replays (routing included: alignment is on the device);
the grouped PyTorch reference syncs for its per-expert split, so it is timed with launches.
"""
from __future__ import annotations

import argparse

import torch

from bench_kernels import bench, bench_launched, ceilings  # scripts/ is on sys.path when a script runs

from pagedserve.kernels import torch_moe
from pagedserve.kernels.triton import moe as triton_moe

HIDDEN, INTER, EXPERTS, TOP_K = 2048, 1024, 64, 8
DT = torch.bfloat16


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


def rows(bw: float, flops: float) -> list[tuple]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=None, help="append the markdown table to this file")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_moe_kernel.py needs a CUDA GPU")
    bw, flops = ceilings()
    lines = [f"\n### Fused MoE, OLMoE-1B-7B expert layer (H {HIDDEN}, I {INTER}, {EXPERTS} experts, top {TOP_K}), "
             f"bf16, {torch.cuda.get_device_name()}",
             f"measured: copy {bw / 1e9:.0f} GB/s, bf16 matmul {flops / 1e12:.0f} TFLOP/s", "",
             "| case | ms | bandwidth floor ms | FLOP floor ms | x max(floor) |", "|---|---:|---:|---:|---:|"]
    for name, ms, bw_ms, fl_ms in rows(bw, flops):
        lines.append(f"| {name} | {ms:.4f} | {bw_ms:.4f} | {fl_ms:.4f} | {ms / max(bw_ms, fl_ms):.2f} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()
