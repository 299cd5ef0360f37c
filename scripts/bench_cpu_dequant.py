"""Where the widen-then-dense CPU path beats torch's weight-only kernels (kernels/weight_only.py's thresholds).

For each weight shape of SmolLM2-135M (the embedded model: the four int4 projections of a layer and the
49152-row int8 tied head with Q8_0's 32-wide groups) and each number of input rows, the packed kernel and
the dense path run alternately, REPEATS times each; the table has the medians in ms and the ratio.

    python scripts/bench_cpu_dequant.py --out benchmarks/cpu_dequant.md
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time
from collections.abc import Callable

import torch

from bench_report import emit                 # scripts/ is on sys.path when a script runs
from pagedserve.common.dtype import cpu_has_native_bf16
from pagedserve.kernels import cpu_dequant, cpu_native
from pagedserve.kernels.weight_only import int4_linear, int8_linear, pack_int4, quantize_int8

NEVER, ALWAYS = 10 ** 9, 1
INT4_SHAPES = {"qkv_proj 576->960": (960, 576), "o_proj 576->576": (576, 576),
               "gate_up_proj 576->3072": (3072, 576), "down_proj 1536->576": (576, 1536)}
ROWS = (1, 8, 16, 32, 48, 64, 96, 128, 256, 512)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1e3


def compare(packed: Callable[[], object], dense: Callable[[], object], repeats: int) -> tuple[float, float]:
    packed(), dense()                                  # warm-up (first calls allocate)
    a, b = [], []
    for _ in range(repeats):
        a.append(timed(packed))
        b.append(timed(dense))
    return statistics.median(a), statistics.median(b)


def rows_for(name: str, rows: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(r for r in rows if "head" not in name or r <= 256)     # the head is the slow one: cap it


def run(repeats: int, rows: tuple[int, ...]) -> list[tuple[str, int, float, float]]:
    torch.manual_seed(0)
    weights: dict[str, Callable[[torch.Tensor, int], torch.Tensor]] = {}
    for name, (out, cols) in INT4_SHAPES.items():
        w = pack_int4(torch.randint(0, 16, (out, cols), dtype=torch.uint8), torch.rand(out, cols // 32) * 0.01,
                      torch.rand(out, cols // 32) * 0.01, 32, "cpu")
        weights[name] = lambda x, m, w=w: int4_linear(x, w, dense_min_rows=m)
    head = quantize_int8(torch.randn(49152, 576), chunk=32)
    weights["tied head (int8, 18 chunks) 576->49152"] = lambda x, m: int8_linear(x, head, dense_min_rows=m)
    results = []
    for name, fn in weights.items():
        cols = 1536 if name.startswith("down") else 576
        for m in rows_for(name, rows):
            x = torch.randn(m, cols)
            a, b = compare(lambda: fn(x, NEVER), lambda: fn(x, ALWAYS), repeats)
            results.append((name, m, a, b))
            print(f"{name:42s} rows {m:4d}: packed {a:8.3f} ms  dense {b:8.3f} ms  {a / b:5.2f}x", flush=True)
    return results


def report(results: list[tuple[str, int, float, float]], repeats: int) -> str:
    lines = [f"### Packed weight-only kernels against widen-then-dense on CPU ({time.strftime('%Y-%m-%d %H:%M')}, "
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
             f"{torch.__version__}, native bf16: {cpu_has_native_bf16()})", "",
             f"Median ms of {repeats} alternated calls each; speed-up = packed / dense (above 1: dense wins).", "",
             "| weight | rows | packed ms | dense ms | speed-up |", "|---|---:|---:|---:|---:|"]
    lines += [f"| {n} | {m} | {a:.3f} | {b:.3f} | {a / b:.2f}x |" for n, m, a, b in results]
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--rows", default=",".join(map(str, ROWS)), help="comma-separated input row counts")
    p.add_argument("--out", default=None, help="append the markdown table to this file")
    args = p.parse_args()
    if cpu_native.library() is None:
        raise SystemExit("no C compiler: the dense path is unavailable here")
    rows = tuple(int(r) for r in args.rows.split(","))
    emit(report(run(args.repeats, rows), args.repeats), args.out)


if __name__ == "__main__":
    main()
