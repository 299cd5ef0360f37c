"""The int8-input int4 GEMM (prefill chunks, big batches) on its AMX tile against its VNNI tile, per shape.

    .venv/bin/python scripts/bench_cpu_gemm.py --result-file benchmarks/results/cpu_gemm_amx.jsonl

Shapes are the 1.7B and 360M ladder models' linears (out x in: q/o, gate/up fused, down), group 32 symmetric
(GGUF Q4_0) and group 32 with zeros (Q4_K's affine groups as the CPU pack holds them), random codes and
scales. Both kernels take the same call (ps_gemm_int4_s8 with and without AMX), alternated, best of --repeats;
the outputs are checked equal to the bit. GMAC/s = rows x out x in multiply-adds per second.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

from pagedserve.common.config.dtype import cpuinfo_field
from pagedserve.frontend.bench.results import append_result, run_metadata
from pagedserve.kernels.cpu import native as cpu_native

SHAPES = {"1.7b": [(2048, 2048), (16384, 2048), (2048, 8192)], "360m": [(960, 960), (5120, 960), (960, 2560)]}


def call(lib, kernel: str, packed: torch.Tensor, sz: torch.Tensor, x: torch.Tensor, y: torch.Tensor,
         threads: int) -> float:
    n, k = packed.shape[0] * 64, packed.shape[1]
    start = time.perf_counter()
    rc = getattr(lib, kernel)(packed.data_ptr(), sz.data_ptr(), sz.shape[-1], n, k, k // sz.shape[0], x.data_ptr(),
                              x.shape[0], y.data_ptr(), threads)
    elapsed = time.perf_counter() - start
    if rc:
        raise RuntimeError(f"{kernel} returned {rc}")
    return elapsed


def cpu_model() -> str:
    """/proc/cpuinfo's model name (the figures are this CPU's alone)."""
    return cpuinfo_field("model name") or "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, nargs="+", default=[256, 512, 2048])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--result-file", default=None)
    args = p.parse_args()
    lib = cpu_native.library()
    if lib is None or not lib.ps_gemm_int4_s8_amx():
        sys.exit("needs the C kernels and a CPU whose kernel grants AMX")
    gen = torch.Generator().manual_seed(0)
    for size, shapes in SHAPES.items():
        for (n, k) in shapes:
            packed = torch.randint(0, 256, (n // 64, k, 32), dtype=torch.uint8, generator=gen)
            for stride in (1, 2):
                sz = (torch.rand(k // 32, n, stride, generator=gen) * 0.01).to(torch.bfloat16)
                for rows in args.rows:
                    x = torch.randn(rows, k, generator=gen)
                    ys = {kernel: torch.empty(rows, n) for kernel in ("ps_gemm_int4_s8_vnni", "ps_gemm_int4_s8")}
                    best = {kernel: float("inf") for kernel in ys}
                    for _ in range(args.repeats):
                        for kernel, y in ys.items():
                            best[kernel] = min(best[kernel], call(lib, kernel, packed, sz, x, y, args.threads))
                    if not torch.equal(*ys.values()):
                        raise RuntimeError(f"AMX and VNNI outputs differ at {n}x{k}, {rows} rows")
                    macs = rows * n * k / 1e9
                    label = f"{size} {n}x{k} {'zeros' if stride == 2 else 'symmetric'} {rows} rows"
                    row = {**run_metadata("cpu_gemm_amx", label), "cpu": cpu_model(), "size": size, "out": n,
                           "in": k, "group": 32,
                           "zeros": stride == 2, "rows": rows, "threads": args.threads,
                           "vnni_ms": best["ps_gemm_int4_s8_vnni"] * 1e3, "amx_ms": best["ps_gemm_int4_s8"] * 1e3,
                           "vnni_gmac_s": macs / best["ps_gemm_int4_s8_vnni"],
                           "amx_gmac_s": macs / best["ps_gemm_int4_s8"],
                           "speedup": best["ps_gemm_int4_s8_vnni"] / best["ps_gemm_int4_s8"]}
                    print(f"{size} {n}x{k} zeros={stride == 2} rows={rows}: VNNI {row['vnni_gmac_s']:.0f} GMAC/s, "
                          f"AMX {row['amx_gmac_s']:.0f} GMAC/s, {row['speedup']:.2f}x")
                    if args.result_file:
                        append_result(args.result_file, row)


if __name__ == "__main__":
    main()
