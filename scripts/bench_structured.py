"""Structured outputs cost: W1 with half of its requests under a JSON Schema, next to plain W1, in one run.

W1 (see bench_throughput.py): 64 requests from random.Random(0), prompt 32-512 random ids, max_tokens 32-256,
ignore_eos, all submitted at once. The constrained run puts every other request under SCHEMA (a grammar
ends such a request when its document is complete, so it may produce fewer tokens: the rate compared is
output tokens per second). Runs alternate plain / constrained, `--repeats` times each, in one engine.
Then the compile time of each test schema: cold (a fresh compile) and cached (the same spec again).

    python scripts/bench_structured.py --out benchmarks/structured_outputs_cpu.md
"""
from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time

from bench_report import emit  # scripts/ is on sys.path when a script runs
from bench_throughput import workload_w1

# Long enough documents that constrained requests decode for a while, as the plain ones do.
SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "notes": {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 10}, "v": {"type": "number"}}, "required": ["k", "v"]},
        "maxItems": 6}},
    "required": ["title", "tags", "rating", "notes"]}


def run_once(llm, reqs, constrained: bool) -> dict:
    from pagedserve import SamplingParams, StructuredOutputsParams
    params = []
    for i, (_, max_tokens) in enumerate(reqs):
        so = StructuredOutputsParams(json=SCHEMA) if constrained and i % 2 == 0 else None
        params.append(SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0,
                                     structured_outputs=so))
    start = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stops = sum(o.outputs[0].finish_reason == "stop" for o in outs)
    return {"tokens": tokens, "seconds": elapsed, "tok_s": tokens / elapsed, "stops": stops}


def compile_times(llm) -> list[tuple[str, float, float]]:
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))
    from pagedserve.common.structured_outputs import StructuredOutputsParams
    from pagedserve.tests.helpers.schemas import SCHEMAS
    manager = llm.engine.structured_outputs
    rows = []
    for i, schema in enumerate([SCHEMA, *SCHEMAS]):
        spec = StructuredOutputsParams(json={**schema, "x-bench": i})    # never compiled before
        start = time.perf_counter()
        manager.submit(spec).compiled.result()
        cold = time.perf_counter() - start
        start = time.perf_counter()
        manager.submit(spec).compiled.result()
        rows.append((f"W1 schema" if i == 0 else f"test schema {i - 1}", cold, time.perf_counter() - start))
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from pagedserve import LLM
    llm = LLM(dtype=args.dtype, max_num_seqs=128, max_num_batched_tokens=2048)
    reqs = workload_w1(args.num_requests)
    # Warm up: the tokenizer load for grammars, a first compile, and the first full-size batch (the
    # allocator grows its pools then; a cold first run measured 0.7x of the next) are not what is compared.
    run_once(llm, reqs[:2], constrained=True)
    run_once(llm, reqs, constrained=False)
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r in range(args.repeats):
        for constrained in ((False, True) if r % 2 == 0 else (True, False)):   # alternate, so drift cancels
            res = run_once(llm, reqs, constrained)
            runs[constrained].append(res)
            print(f"repeat {r} {'constrained' if constrained else 'plain'}: {res}", flush=True)
    compiles = compile_times(llm)
    llm.shutdown()
    lines = [f"\n### W1 plain vs half under a JSON Schema ({args.num_requests} requests, {args.dtype}, "
             f"{platform.machine()}, {os.cpu_count()} cores)\n",
             "| run | output tokens | seconds | output tok/s | finished by grammar |", "|---|---|---|---|---|"]
    for r in range(args.repeats):
        for constrained in (False, True):
            x = runs[constrained][r]
            lines.append(f"| {r + 1} {'constrained' if constrained else 'plain'} | {x['tokens']} | "
                         f"{x['seconds']:.1f} | {x['tok_s']:.1f} | {x['stops']} |")
    plain = statistics.mean(x["tok_s"] for x in runs[False])
    cons = statistics.mean(x["tok_s"] for x in runs[True])
    pairs = ", ".join(f"{c['tok_s'] / q['tok_s']:.3f}" for q, c in zip(runs[False], runs[True]))
    lines.append(f"\nMean output tok/s: plain {plain:.1f}, constrained {cons:.1f}: ratio {cons / plain:.3f} "
                 f"(per pair: {pairs}; target >= 0.9).\n")
    lines += ["| schema | cold compile (ms) | cached (ms) |", "|---|---|---|"]
    lines += [f"| {name} | {cold * 1000:.1f} | {cached * 1000:.3f} |" for name, cold, cached in compiles]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
