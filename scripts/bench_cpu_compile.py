"""Does torch.compile pay on CPU? The embedded model's decode steps with its elementwise ops eager or compiled.

At batches of more than 8 sequences the PyTorch layers run (the one-call C step takes 1-8), and between the
linears and the attention (C kernels, reached through ctypes: graph breaks) the ops left to fuse are the
add+RMSNorm pairs, the q/k rotary and SiLU*up. This swaps `kernels/torch_fused.py`'s three functions for
`torch.compile(..., dynamic=True)` versions of themselves in one process, and alternates eager and compiled
runs: ms per decode step = (t(steps + 1 tokens) - t(1 token)) / steps, best of `--repeats` pairs. It also
reports the compile time the first compiled run paid.

    python scripts/bench_cpu_compile.py --out benchmarks/cpu_compile.md
"""
from __future__ import annotations

import argparse
import platform
import time

import torch

from bench_report import emit                 # scripts/ is on sys.path when a script runs

OPS = ("rms_norm", "silu_and_mul", "qk_norm_rope")


def step_ms(llm, batch: int, steps: int) -> float:
    from pagedserve import SamplingParams
    prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 9000 for j in range(128)]} for i in range(batch)]

    def run(n: int) -> float:
        start = time.perf_counter()
        llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)
        return time.perf_counter() - start
    return (run(steps + 1) - run(1)) / steps * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="16,64")
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from pagedserve import LLM
    from pagedserve.kernels import torch_fused
    eager = {name: getattr(torch_fused, name) for name in OPS}
    compiled = {name: torch.compile(fn, dynamic=True) for name, fn in eager.items()}
    llm = LLM(max_model_len=1024)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        step_ms(llm, batch, 2)                                     # eager warm-up
        for name, fn in compiled.items():
            setattr(torch_fused, name, fn)
        start = time.perf_counter()
        step_ms(llm, batch, 2)                                     # compiles (prefill and decode shapes)
        compile_s = time.perf_counter() - start
        times: dict[str, list[float]] = {"eager": [], "compiled": []}
        for _ in range(args.repeats):
            for label, fns in (("eager", eager), ("compiled", compiled)):
                for name, fn in fns.items():
                    setattr(torch_fused, name, fn)
                times[label].append(step_ms(llm, batch, args.steps))
        for name, fn in eager.items():
            setattr(torch_fused, name, fn)
        e, c = min(times["eager"]), min(times["compiled"])
        rows.append(f"| {batch} | {e:.1f} | {c:.1f} | {e / c:.2f}x | {compile_s:.0f} |")
        print(rows[-1], times, flush=True)
    llm.shutdown()
    head = [f"### Decode step with the elementwise ops eager or torch.compile'd ({time.strftime('%Y-%m-%d %H:%M')}, "
            f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch "
            f"{torch.__version__})", "",
            f"Best of {args.repeats} alternated runs, ms per step of {args.steps} decode steps over 128-token prompts; "
            "first compiled run: seconds to compile and run 2 steps.", "",
            "| batch | eager ms/step | compiled ms/step | speed-up | compile s |", "|---:|---:|---:|---:|---:|"]
    emit("\n".join(head + rows) + "\n", args.out)


if __name__ == "__main__":
    main()
