"""CPU paged decode attention: the C kernel (kernels/csrc/decode_attention.c) against the SDPA path
(kernels/cpu_attention.py's gather-and-attend), on SmolLM2-135M's heads (9 query, 3 KV, dim 64), float32.

Each call follows a torch GEMM, as inside a model (torch's OpenMP threads are then still spinning, which
slows whatever runs next); the two paths alternate, ROUNDS calls each, medians reported.

    python scripts/bench_cpu_attention.py --out benchmarks/cpu_attention.md
"""
from __future__ import annotations

import argparse
import platform
import random
import statistics
import time

import torch

from bench_report import emit                 # scripts/ is on sys.path when a script runs
from pagedserve.kernels import cpu_attention
from pagedserve.tests.helpers.attention_cases import make_batch

CASES = [(1, 128, 256), (16, 100, 700), (64, 128, 192), (64, 100, 700)]   # (decodes, context min, max)


def measure(batch: int, lo: int, hi: int, rounds: int, dtype: torch.dtype) -> tuple[float, float]:
    rng = random.Random(batch * 1000 + hi)
    seqs = sorted((rng.randint(lo, hi), 1) for _ in range(batch))
    gen = torch.Generator().manual_seed(0)
    k_cache, v_cache, _, meta = make_batch(seqs, 16, 3, 64, gen, dtype=dtype)
    kv = torch.stack((k_cache, v_cache))
    k_cache, v_cache = kv[0], kv[1]
    q = torch.randn(batch, 9, 64, generator=gen).to(dtype)
    kv_rows = cpu_attention.stacked_rows(k_cache, v_cache)

    def sdpa() -> torch.Tensor:
        plan = cpu_attention.step_plan(meta, k_cache, kv_rows is not None)
        return cpu_attention.paged_attention(q, k_cache, v_cache, kv_rows, plan, 0.125)

    def native() -> torch.Tensor:
        out = cpu_attention.decode_native(q, k_cache, v_cache, meta, 0.125)
        if out is None:
            raise SystemExit("the C kernel is unavailable here (no C compiler)")
        return out

    torch.testing.assert_close(sdpa().float(), native().float(), rtol=2e-2, atol=2e-2)
    x, w = torch.randn(64, 576), torch.randn(576, 3072)
    times: dict[str, list[float]] = {"sdpa": [], "native": []}
    for _ in range(rounds):
        for name, fn in (("sdpa", sdpa), ("native", native)):
            torch.mm(x, w)
            start = time.perf_counter()
            fn()
            times[name].append((time.perf_counter() - start) * 1e3)
    return statistics.median(times["sdpa"]), statistics.median(times["native"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = [f"### CPU paged decode attention, one layer ({time.strftime('%Y-%m-%d %H:%M')}, "
             f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
             f"{torch.__version__})", "", f"Median ms of {args.rounds} alternated calls, each after a GEMM.", "",
             "| decodes | context | cache | SDPA path ms | C kernel ms | speed-up |", "|---:|---|---|---:|---:|---:|"]
    for batch, lo, hi in CASES:
        for dtype in (torch.float32, torch.bfloat16):
            a, b = measure(batch, lo, hi, args.rounds, dtype)
            lines.append(f"| {batch} | {lo}-{hi} | {str(dtype).removeprefix('torch.')} | {a:.3f} | {b:.3f} | "
                         f"{a / b:.2f}x |")
            print(lines[-1], flush=True)
    emit("\n".join(lines) + "\n", args.out)


if __name__ == "__main__":
    main()
