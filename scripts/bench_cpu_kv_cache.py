"""Decode attention of a whole step on CPU with a float32 and a bfloat16 KV cache (the C kernel).

The embedded model's shapes (30 layers, 9 query heads, 3 KV heads, head_dim 64, 16-token blocks), BATCH
sequences of CONTEXT cached tokens each, every layer its own cache as in a real step, so the step's cache
reads stream from memory (at 340 tokens a float32 step reads ~1 GB). Blocks are shuffled as a cache that has
served for a while has them. The two dtypes run alternately; the table has the median ms per step and the
rate the cache was read at.

    python scripts/bench_cpu_kv_cache.py --out benchmarks/cpu_kv_cache.md
"""
from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

from bench_report import emit                 # scripts/ is on sys.path when a script runs
from pagedserve.kernels import cpu_native

LAYERS, HQ, HKV, HEAD_DIM, BLOCK = 30, 9, 3, 64, 16
DTYPES = (torch.float32, torch.bfloat16)


def step_fn(dtype: torch.dtype, batch: int, context: int):
    lib = cpu_native.library()
    nblocks = -(-context // BLOCK)
    gen = torch.Generator().manual_seed(0)
    caches = [torch.randn(2, batch * nblocks, HKV, BLOCK, HEAD_DIM, generator=gen).to(dtype) for _ in range(LAYERS)]
    tables = torch.randperm(batch * nblocks, generator=gen, dtype=torch.int32).view(batch, nblocks).contiguous()
    lens = torch.full((batch,), context, dtype=torch.int32)
    q, out = torch.randn(batch, HQ, HEAD_DIM), torch.empty(batch, HQ, HEAD_DIM)
    threads = torch.get_num_threads()

    def run() -> float:
        start = time.perf_counter()
        for c in caches:
            cpu_native.check(lib.ps_paged_decode(q.data_ptr(), c[0].data_ptr(), c[1].data_ptr(),
                                                 int(dtype == torch.bfloat16), tables.data_ptr(), nblocks,
                                                 lens.data_ptr(), out.data_ptr(), batch, HQ, HKV, BLOCK, HEAD_DIM,
                                                 HEAD_DIM ** -0.5, threads), "paged decode")
        return (time.perf_counter() - start) * 1e3
    bytes_read = LAYERS * 2 * batch * context * HKV * HEAD_DIM * caches[0].element_size()
    return run, bytes_read


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--contexts", default="150,340")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    if cpu_native.library() is None:
        raise SystemExit("no C compiler: the C attention kernel is unavailable here")
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        runs = {d: step_fn(d, args.batch, context) for d in DTYPES}
        for fn, _ in runs.values():
            fn()
        times = {d: [] for d in DTYPES}
        for _ in range(args.repeats):
            for d, (fn, _) in runs.items():
                times[d].append(fn())
        med = {d: statistics.median(t) for d, t in times.items()}
        for d in DTYPES:
            gb = runs[d][1] / 1e9
            rows.append(f"| {context} | {str(d).removeprefix('torch.')} | {med[d]:.1f} | {gb:.2f} | "
                        f"{gb / med[d] * 1e3:.1f} | {med[torch.float32] / med[d]:.2f}x |")
            print(rows[-1], flush=True)
        del runs
    head = [f"### Decode attention of a {args.batch}-sequence step, 30 layers, by KV-cache dtype "
            f"({time.strftime('%Y-%m-%d %H:%M')}, {platform.processor() or platform.machine()}, "
            f"{torch.get_num_threads()} threads)", "",
            f"Median of {args.repeats} alternated runs; GB read = K and V of every cached token of every layer.", "",
            "| context | cache | ms per step | GB read | GB/s | vs float32 |", "|---:|---|---:|---:|---:|---:|"]
    emit("\n".join(head + rows) + "\n", args.out)


if __name__ == "__main__":
    main()
