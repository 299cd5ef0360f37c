"""Where a CPU decode step's time goes, by kind of op, at batch 1 and batch 64.

    python scripts/profile_cpu_step.py --engine before:quantization=none,dtype=bfloat16 \
        --engine after: --out benchmarks/cpu_step_profile.md

Each engine (name:field=value,... over EngineArgs, env.NAME=value for an environment variable set while it
loads, e.g. env.PAGEDSERVE_CPU_DECODE_STEP=0; empty = defaults) loads the embedded model, runs `batch`
requests of 128 prompt tokens to 64 decode steps under torch.profiler, and sums the ops' own CPU time per
kind. The wall time per step is measured in a second, unprofiled run (the profiler adds overhead).
"""
from __future__ import annotations

import argparse
import os
import platform
import time
from collections import defaultdict

import torch
from bench_report import emit  # scripts/ is on sys.path when a script runs

KINDS = [  # (kind, substrings of aten op names), first match wins
    ("int4 GEMM", ("_weight_int4pack_mm",)),
    ("int8 GEMM", ("_weight_int8pack_mm",)),
    ("dense GEMM", ("aten::mm", "aten::addmm", "aten::bmm", "aten::linear", "aten::matmul")),
    ("attention", ("scaled_dot_product", "_flash_attention", "index_select", "gather")),
    ("KV write", ("index_put", "index_copy")),
    ("elementwise/norm/rope", ("aten::mul", "aten::add", "aten::silu", "aten::rsqrt", "aten::pow", "aten::mean",
                               "aten::neg", "aten::cat", "aten::sub", "aten::div", "aten::where", "aten::exp")),
    ("copies/casts", ("aten::copy_", "aten::_to_copy", "aten::to", "aten::contiguous", "aten::clone")),
    ("sampling", ("argmax", "topk", "sort", "softmax", "log_softmax", "multinomial")),
]


def parse_engine(text: str) -> tuple[str, dict, dict]:
    """(name, EngineArgs fields, environment variables)."""
    name, _, opts = text.partition(":")
    kwargs, env = {}, {}
    for item in filter(None, opts.split(",")):
        key, _, value = item.partition("=")
        if key.startswith("env."):
            env[key[4:]] = value
        else:
            kwargs[key] = value
    return name, kwargs, env


def kind_of(name: str) -> str:
    for kind, keys in KINDS:
        if any(k in name for k in keys):
            return kind
    return "other"


def run(llm, batch: int, steps: int, profiled: bool) -> tuple[float, dict[str, float]]:
    from pagedserve import SamplingParams
    prompts = [{"prompt_token_ids": [100 + (7 * i + j) % 9000 for j in range(128)]} for i in range(batch)]
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    llm.generate(prompts, params, use_tqdm=False)                     # prefill cost, subtracted below
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)
    prefill = time.perf_counter() - start
    long = SamplingParams(max_tokens=steps + 1, ignore_eos=True, temperature=0.0)
    kinds: dict[str, float] = defaultdict(float)
    if profiled:
        from torch.profiler import profile
        with profile() as prof:
            llm.generate(prompts, long, use_tqdm=False)
        for event in prof.key_averages():
            kinds[kind_of(event.key)] += event.self_cpu_time_total / 1e3 / steps
        return 0.0, kinds
    start = time.perf_counter()
    llm.generate(prompts, long, use_tqdm=False)
    return (time.perf_counter() - start - prefill) / steps * 1e3, kinds


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--engine", action="append", required=True)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from pagedserve import LLM
    rows = []
    for spec in args.engine:
        name, kwargs, env = parse_engine(spec)
        saved = {key: os.environ.get(key) for key in env}
        os.environ.update(env)
        llm = LLM(max_model_len=512, **kwargs)
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key)
            else:
                os.environ[key] = value
        dtype = llm.engine.config.model.dtype
        for batch in (int(b) for b in args.batches.split(",")):
            wall, _ = run(llm, batch, args.steps, profiled=False)
            _, kinds = run(llm, batch, args.steps, profiled=True)
            total = sum(kinds.values())
            shares = " | ".join(f"{kinds.get(k, 0.0):.2f}" for k, _ in KINDS + [("other", ())])
            rows.append(f"| {name} ({dtype}) | {batch} | {wall:.2f} | {total:.2f} | {shares} |")
            print(rows[-1], flush=True)
        llm.shutdown()
    head = [f"### Decode step on CPU by kind of op ({platform.machine()}, {os.cpu_count()} cores, torch "
            f"{torch.__version__}, {torch.get_num_threads()} threads)", "",
            "ms per decode step: `wall` unprofiled; the rest is profiled own CPU time per kind (summed over "
            "threads' ops as torch.profiler reports them, so it can differ from wall).", "",
            "| engine | batch | wall | profiled total | " + " | ".join(k for k, _ in KINDS) + " | other |",
            "|---" * (len(KINDS) + 5) + "|"]
    emit("\n".join(head + rows) + "\n", args.out)


if __name__ == "__main__":
    main()
