"""`pagedserve bench throughput`: offline throughput of pagedserve's LLM (or HF transformers' static batches)
on one set of requests, all submitted at once, as `vllm bench throughput` measures it.

    pagedserve bench throughput --dataset-name w1 --num-iters-warmup 1 --result-file benchmarks/results/cpu.jsonl
    pagedserve bench throughput --dataset-name w1 --backend hf --hf-max-batch-size 16 --dtype bfloat16
    pagedserve bench throughput --make-model qwen3-0.6b --model /tmp/qwen3-0.6b --dataset-name g1 \\
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2048

Every request runs greedy with ignore_eos, so it makes exactly its max_tokens; the count is checked.
--structured-output-ratio puts that share of the requests under a JSON Schema (the cost of structured outputs).
"""
from __future__ import annotations

import argparse
import json
import math
import resource
import time
from typing import Any

from pagedserve.frontend.bench import datasets
from pagedserve.frontend.bench.engine_flags import add_engine_args, engine_settings, make_llm, prepare_model
from pagedserve.frontend.bench.results import append_result, run_metadata

# Long enough documents that constrained requests decode for a while, as the plain ones do.
DEFAULT_SCHEMA: dict[str, Any] = {"type": "object", "properties": {
    "title": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 8},
    "rating": {"type": "integer", "minimum": 1, "maximum": 5},
    "notes": {"type": "array", "items": {"type": "object", "properties": {
        "k": {"type": "string", "maxLength": 10}, "v": {"type": "number"}}, "required": ["k", "v"]},
        "maxItems": 6}},
    "required": ["title", "tags", "rating", "notes"]}


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--backend", default="pagedserve", choices=("pagedserve", "hf"))
    parser.add_argument("--hf-max-batch-size", type=int, default=None, help="hf: requests per static batch")
    datasets.add_dataset_args(parser)
    parser.add_argument("--num-iters-warmup", type=int, default=0,
                        help="untimed runs of the same requests first (allocator pools, grammar compiles)")
    parser.add_argument("--structured-output-ratio", type=float, default=0.0,
                        help="share of the requests (spread evenly) generated under --json-schema")
    parser.add_argument("--json-schema", default=None, help="a JSON Schema file (default: a built-in document)")
    parser.add_argument("--label", default=None, help="names the engine in results (default: the backend)")
    parser.add_argument("--result-file", default=None, help="append one JSON line to this file")
    add_engine_args(parser)


def _check(args: argparse.Namespace) -> dict[str, Any] | None:
    datasets.check_dataset_args(args)
    if args.backend == "hf" and (args.hf_max_batch_size is None or args.hf_max_batch_size < 1):
        raise ValueError("--backend hf needs --hf-max-batch-size >= 1")
    if args.backend != "hf" and args.hf_max_batch_size is not None:
        raise ValueError("--hf-max-batch-size is for --backend hf only")
    if not 0.0 <= args.structured_output_ratio <= 1.0:
        raise ValueError(f"--structured-output-ratio must be in [0, 1], got {args.structured_output_ratio}")
    if args.structured_output_ratio and args.backend == "hf":
        raise ValueError("--structured-output-ratio is for --backend pagedserve only")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    if args.json_schema is None:
        return DEFAULT_SCHEMA if args.structured_output_ratio else None
    with open(args.json_schema, encoding="utf-8") as f:
        return json.load(f)


def main(args: argparse.Namespace) -> dict[str, Any]:
    try:
        schema = _check(args)
        prepare_model(args)
        run = run_hf(args) if args.backend == "hf" else run_pagedserve(args, schema)
    except (ValueError, OSError) as exc:
        raise SystemExit(f"pagedserve bench throughput: {exc}") from None
    n, seconds = run["num_requests"], run["elapsed_time"]
    total = run["total_prompt_tokens"] + run["total_output_tokens"]
    run.update(total_num_tokens=total, requests_per_second=n / seconds, tokens_per_second=total / seconds,
               output_tokens_per_second=run["total_output_tokens"] / seconds,
               peak_rss_mib=resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    print(f"Throughput: {n / seconds:.2f} requests/s, {total / seconds:.2f} total tokens/s, "
          f"{run['output_tokens_per_second']:.2f} output tokens/s")
    print(f"Total num prompt tokens:  {run['total_prompt_tokens']}")
    print(f"Total num output tokens:  {run['total_output_tokens']}", flush=True)
    record = {**run_metadata("throughput", args.label or args.backend, args.command_line),
              "backend": args.backend, **engine_settings(args), **datasets.dataset_settings(args, n), **run}
    if args.result_file:
        append_result(args.result_file, record)
    return record


def constrained(i: int, ratio: float) -> bool:
    """Whether request i is under the schema: `ratio` of the requests, spread evenly, the first included."""
    return math.ceil((i + 1) * ratio) > math.ceil(i * ratio)


def run_pagedserve(args: argparse.Namespace, schema: dict[str, Any] | None) -> dict[str, Any]:
    from pagedserve.common.params.sampling_params import SamplingParams
    from pagedserve.common.params.structured_outputs import StructuredOutputsParams

    llm = make_llm(args)
    try:
        reqs = datasets.sample_requests(args, llm.info.vocab_size, args.seed)
        params = [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True,
                                 structured_outputs=StructuredOutputsParams(json=schema)
                                 if schema is not None and constrained(i, args.structured_output_ratio) else None)
                  for i, r in enumerate(reqs)]
        prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
        for _ in range(args.num_iters_warmup):
            llm.generate(prompts, params, use_tqdm=False)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=True)
        elapsed = time.perf_counter() - start
        result = {"elapsed_time": elapsed, "num_requests": len(reqs),
                  "total_prompt_tokens": sum(r.prompt_len for r in reqs),
                  "total_output_tokens": sum(len(o.outputs[0].token_ids) for o in outs)}
        _check_lengths(reqs, outs, params)
        if schema is not None:
            result["structured_output_ratio"] = args.structured_output_ratio
            result["finished_by_grammar"] = sum(o.outputs[0].finish_reason == "stop" for o in outs)
            result.update(compile_times(llm, schema))
        return result
    finally:
        llm.shutdown()


def _check_lengths(reqs: list[datasets.SampleRequest], outs: list[Any], params: list[Any]) -> None:
    """ignore_eos makes every unconstrained request exactly its max_tokens: anything else is a bug worth
    stopping a benchmark for (a grammar may end its request sooner, by design)."""
    for r, o, p in zip(reqs, outs, params):
        made = len(o.outputs[0].token_ids)
        if p.structured_outputs is None and made != r.expected_output_len:
            raise RuntimeError(f"pagedserve made {made} tokens, asked for {r.expected_output_len}")


def compile_times(llm: Any, schema: dict[str, Any]) -> dict[str, float]:
    """The schema's grammar compiled cold (a spec never seen: a marker key makes it new) and from the cache,
    in the engine's own compiler; in-process engines only."""
    from pagedserve.common.params.structured_outputs import StructuredOutputsParams
    if llm.engine is None:
        return {}
    spec = StructuredOutputsParams(json={**schema, "x-bench": time.time_ns()})
    times = []
    for _ in range(2):
        start = time.perf_counter()
        llm.engine.structured_outputs.submit(spec).compiled.result()
        times.append((time.perf_counter() - start) * 1e3)
    return {"schema_compile_cold_ms": times[0], "schema_compile_cached_ms": times[1]}


def run_hf(args: argparse.Namespace) -> dict[str, Any]:
    from pagedserve.frontend.bench.hf_backend import hf_static_generate, load_hf_model
    model, device = load_hf_model(args.model, args.dtype, args.device)
    reqs = datasets.sample_requests(args, model.config.vocab_size, args.seed)
    pairs = [(r.prompt, r.expected_output_len) for r in reqs]
    for _ in range(args.num_iters_warmup):
        hf_static_generate(model, device, pairs, args.hf_max_batch_size)
    start = time.perf_counter()
    tokens = hf_static_generate(model, device, pairs, args.hf_max_batch_size)
    return {"elapsed_time": time.perf_counter() - start, "num_requests": len(reqs),
            "total_prompt_tokens": sum(r.prompt_len for r in reqs), "total_output_tokens": tokens,
            "hf_max_batch_size": args.hf_max_batch_size}
