"""`pagedserve bench latency`: how long one batch of requests takes, per batch size, as `vllm bench latency`
measures it, plus the decode time per token with the prefill taken out.

For each --batch-size, `batch` random prompts of --input-len ids generate --output-len tokens each (greedy,
ignore_eos): --num-iters-warmup untimed runs, then --num-iters timed ones. Beside each timed run a 1-token run
of the same prompts (prefill and first token only) is timed, and
    decode ms per token = (median t(output-len tokens) - median t(1 token)) / (output-len - 1),
the single-stream number at batch 1. --bandwidth-bound adds the floor a decode step cannot beat: the model's
weight bytes over the copy bandwidth measured on its device.

    pagedserve bench latency --batch-size 1 8 64 --input-len 128 --output-len 128 --plot latency.png
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from typing import Any

import numpy as np

from pagedserve.frontend.bench.engine_flags import add_engine_args, engine_settings, make_llm, prepare_model
from pagedserve.frontend.bench.results import append_result, run_metadata

PERCENTILES = (10, 25, 50, 75, 90, 99)


def add_cli_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--input-len", type=int, default=32, help="prompt tokens of every request")
    parser.add_argument("--output-len", type=int, default=128, help="output tokens of every request")
    parser.add_argument("--batch-size", type=int, nargs="+", default=[8], help="one run per value")
    parser.add_argument("--num-iters-warmup", type=int, default=10)
    parser.add_argument("--num-iters", type=int, default=30)
    parser.add_argument("--profile", action="store_true",
                        help="after timing, run one batch under torch.profiler and print its ops by own time")
    parser.add_argument("--bandwidth-bound", action="store_true",
                        help="report weight bytes / measured copy bandwidth (in-process engines only)")
    parser.add_argument("--label", default=None, help="names the engine in results and plots (default: pagedserve)")
    parser.add_argument("--result-file", default=None, help="append one JSON line per batch size to this file")
    parser.add_argument("--plot", default=None,
                        help="draw output tok/s and decode ms/token against batch size into this PNG, one line "
                             "per label of the result file (or of this run without one)")
    add_engine_args(parser)


def _check(args: argparse.Namespace) -> None:
    for flag in ("input_len", "output_len", "num_iters"):
        if getattr(args, flag) < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    if args.num_iters_warmup < 0:
        raise ValueError(f"--num-iters-warmup must be >= 0, got {args.num_iters_warmup}")
    if any(b < 1 for b in args.batch_size):
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")


def main(args: argparse.Namespace) -> list[dict[str, Any]]:
    try:
        _check(args)
        prepare_model(args)
        llm = make_llm(args)
    except ValueError as exc:
        raise SystemExit(f"pagedserve bench latency: {exc}") from None
    records = []
    try:
        bound = bandwidth_bound(llm) if args.bandwidth_bound else None
        for batch in args.batch_size:
            result = run_batch(llm, args, batch)
            if bound is not None:
                result.update(bound)
            record = {**run_metadata("latency", args.label or "pagedserve", args.command_line),
                      **engine_settings(args), **result}
            _print(record)
            if args.result_file:
                append_result(args.result_file, record)
            records.append(record)
        if args.profile:
            profile_batch(llm, args, args.batch_size[-1])
    finally:
        llm.shutdown()
    if args.plot:
        from pagedserve.frontend.bench.plot import plot_batch
        plot_batch(args.plot, args.result_file, records)
    return records


def _prompts(vocab_size: int, batch: int, input_len: int, seed: int) -> list[dict[str, list[int]]]:
    rng = random.Random(seed)
    high = max(101, min(vocab_size, 49000))
    return [{"prompt_token_ids": [rng.randrange(100, high) for _ in range(input_len)]} for _ in range(batch)]


def run_batch(llm: Any, args: argparse.Namespace, batch: int) -> dict[str, Any]:
    from pagedserve.common.params.sampling_params import SamplingParams
    prompts = _prompts(llm.info.vocab_size, batch, args.input_len, args.seed)

    def timed(n: int) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
        if any(len(o.outputs[0].token_ids) != n for o in outs):
            raise RuntimeError(f"pagedserve made another number of tokens than the {n} asked for")
        return seconds

    for _ in range(args.num_iters_warmup):
        timed(args.output_len)
    timed(1)
    full, first = [], []
    for _ in range(args.num_iters):           # alternated, so slow drift of the machine hits both alike
        first.append(timed(1))
        full.append(timed(args.output_len))
    median = statistics.median(full)
    decode = (median - statistics.median(first)) / (args.output_len - 1) * 1e3 if args.output_len > 1 else None
    return {"batch_size": batch, "input_len": args.input_len, "output_len": args.output_len,
            "num_iters": args.num_iters, "avg_latency": float(np.mean(full)), "std_latency": float(np.std(full)),
            "latencies": full, "percentiles": {str(p): float(v) for p, v in zip(PERCENTILES,
                                                                               np.percentile(full, PERCENTILES))},
            "median_first_token_latency": statistics.median(first),
            "output_tokens_per_second": batch * args.output_len / median,
            "ms_per_step": median / args.output_len * 1e3, "decode_ms_per_tok": decode}


def _print(r: dict[str, Any]) -> None:
    print(f"Batch size {r['batch_size']} ({r['input_len']} in, {r['output_len']} out):")
    print(f"Avg latency: {r['avg_latency']} seconds")
    print(f"Std latency: {r['std_latency']} seconds")
    for p, v in r["percentiles"].items():
        print(f"{p}% percentile latency: {v} seconds")
    print(f"Output tokens/s: {r['output_tokens_per_second']:.2f}; decode ms per token: "
          f"{r['decode_ms_per_tok'] if r['decode_ms_per_tok'] is None else round(r['decode_ms_per_tok'], 3)}"
          + (f" (bandwidth bound {r['bound_ms_per_tok']:.3f})" if "bound_ms_per_tok" in r else ""), flush=True)


def bandwidth_bound(llm: Any) -> dict[str, Any] | None:
    """ms a decode step needs at least to read every weight once: model bytes (parameters and buffers, each
    storage once) / the bandwidth of a large copy on the model's device (read + write)."""
    if llm.engine is None or not hasattr(llm.engine.executor, "worker"):
        print("note: --bandwidth-bound needs the in-process engine (no --multiprocess-core, one rank)")
        return None
    model = llm.engine.executor.worker.runner.model
    seen: dict[int, int] = {}
    for t in [*model.parameters(), *model.buffers()]:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    weight_bytes = sum(seen.values())
    device = next(model.parameters()).device
    bandwidth = copy_bandwidth(device)
    return {"weight_bytes": weight_bytes, "copy_bandwidth_gbps": bandwidth / 1e9,
            "bound_ms_per_tok": weight_bytes / bandwidth * 1e3, "device": str(device)}


def copy_bandwidth(device: Any, nbytes: int = 1 << 28, repeats: int = 5) -> float:
    """Bytes per second moved (read + write) by the best of `repeats` copies of `nbytes`."""
    import torch
    src = torch.ones(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats + 1):                 # the first copy faults the pages in
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def profile_batch(llm: Any, args: argparse.Namespace, batch: int) -> None:
    """One batch under torch.profiler (CPU, and CUDA when present); its ops by own time. In-process engines
    show the whole step; with --multiprocess-core only this process's side."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from pagedserve.common.params.sampling_params import SamplingParams
    prompts = _prompts(llm.info.vocab_size, batch, args.input_len, args.seed)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True),
                     use_tqdm=False)
    key = "self_cuda_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=key, row_limit=25), flush=True)
