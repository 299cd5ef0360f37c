"""Every int4 path of a CPU linear, per number of input rows, over the embedded model's 30 layers.

SmolLM2-135M's four int4 projections per layer (qkv 576->960, o 576->576, gate_up 576->3072, down
1536->576), 30 distinct copies of each so that the weights stream from memory as in a real step (120
packed weights, ~53 MB). For each row count the paths run alternately, REPEATS times each, and the table
has the median ms for all 120 linears:

- torch: torch's `_weight_int4pack_mm_for_cpu` (bfloat16 activations, as int4_linear called it);
- dense: the weight widened to bfloat16 per call (kernels/csrc/dequant.c), then oneDNN;
- gemv: the float32 AVX-512 GEMVs (kernels/csrc/gemv.c, <= 8 rows);
- gemm: the integer GEMM (kernels/csrc/gemm_int4.c: int16 inputs, AVX512-VNNI).

    python scripts/bench_cpu_gemm_int4.py --out benchmarks/cpu_gemm_int4.md
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from bench_report import emit                 # scripts/ is on sys.path when a script runs
from pagedserve.kernels import cpu_dequant, cpu_native, weight_only

SHAPES = ((960, 576), (576, 576), (3072, 576), (576, 1536))
LAYERS = 30
ROWS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192)
PATHS = ("torch", "dense", "gemv", "gemm")


def weights() -> list[weight_only.Int4Weight]:
    torch.manual_seed(0)
    return [weight_only.pack_int4(torch.randint(0, 16, (out, cols), dtype=torch.uint8),
                                  torch.rand(out, cols // 32) * 0.01, torch.randn(out, cols // 32) * 0.01, 32, "cpu")
            for _ in range(LAYERS) for out, cols in SHAPES]


def one(path: str, x: torch.Tensor, w: weight_only.Int4Weight) -> torch.Tensor:
    if path == "torch":
        return torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w.packed, w.group_size, w.scales_and_zeros)
    if path == "dense":
        return torch.mm(x.to(torch.bfloat16), cpu_dequant.int4_to_bf16_t(
            w.packed, w.scales_and_zeros, w.out_features, w.in_features, w.group_size))
    if path == "gemv":
        return weight_only._int4_gemv(x, w)
    return weight_only._int4_gemm(x, w)


def model_ms(path: str, rows: int, ws: list[weight_only.Int4Weight]) -> Callable[[], float]:
    inputs = {cols: torch.randn(rows, cols) for cols in {c for _, c in SHAPES}}

    def run() -> float:
        start = time.perf_counter()
        for w in ws:
            one(path, inputs[w.in_features], w)
        return (time.perf_counter() - start) * 1e3
    return run


def sweep(rows: tuple[int, ...], repeats: int) -> list[tuple[int, dict[str, float]]]:
    ws = weights()
    lib = cpu_native.library()
    results = []
    for m in rows:
        paths = [p for p in PATHS if (p != "gemv" or m <= weight_only.GEMV_MAX_ROWS)
                 and (p != "gemm" or lib.ps_gemm_int4_vectorized())]
        runs = {p: model_ms(p, m, ws) for p in paths}
        for fn in runs.values():
            fn()                                             # warm-up
        times: dict[str, list[float]] = {p: [] for p in paths}
        for _ in range(repeats):
            for p in paths:
                times[p].append(runs[p]())
        results.append((m, {p: statistics.median(t) for p, t in times.items()}))
        print(m, {p: round(v, 2) for p, v in results[-1][1].items()}, flush=True)
    return results


def report(results: list[tuple[int, dict[str, float]]], repeats: int) -> str:
    lines = [f"### int4 linears of 30 SmolLM2-135M layers on CPU ({time.strftime('%Y-%m-%d %H:%M')}, "
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
             f"{torch.__version__})", "",
             f"Median ms for all 120 linears of {repeats} alternated runs each; `best` is the fastest path.", "",
             "| rows | " + " | ".join(PATHS) + " | best | gemm vs next best |", "|---:" * (len(PATHS) + 3) + "|"]
    for m, t in results:
        cells = " | ".join(f"{t[p]:.2f}" if p in t else "" for p in PATHS)
        best = min(t, key=t.get)
        others = [v for p, v in t.items() if p != "gemm"]
        ratio = f"{min(others) / t['gemm']:.2f}x" if "gemm" in t and others else ""
        lines.append(f"| {m} | {cells} | {best} | {ratio} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated input row counts")
    p.add_argument("--out", default=None, help="append the markdown table to this file")
    args = p.parse_args()
    if cpu_native.library() is None:
        raise SystemExit("no C compiler: the C kernels are unavailable here")
    emit(report(sweep(tuple(int(r) for r in args.rows.split(",")), args.repeats), args.repeats), args.out)


if __name__ == "__main__":
    main()
