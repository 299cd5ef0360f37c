"""W1 with pipeline parallelism (issue 27): PP = 2 against TP = 2 and TP = 1, same run, alternated and repeated,
on a SmolLM2-135M-shaped model with random bf16 weights and 8 heads / 4 KV heads (the embedded model's 9 heads do
not split over 2 ranks; built once into --model unless it exists), each in a child process with the machine's cores shared out (TP = 1: all threads in one
process; two ranks: cores / 2 threads each). For PP = 2 the child also records the batch timeline: when each
batch was started and when its output was taken, and the share of the run with two batches in flight.

Usage: python scripts/bench_pipeline.py [--model /tmp/pp_bench_135m] [--num-requests 32] [--repeats 2]
           [--result-file benchmarks/results/pipeline_w1.jsonl]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_child import emit, report, run_child  # noqa: E402

CONFIGS = {"tp1": dict(tensor_parallel_size=1), "tp2": dict(tensor_parallel_size=2),
           "pp2": dict(pipeline_parallel_size=2)}


def _timeline(core) -> list[tuple[float, float]]:
    """(start, taken) of every batch, recorded around the executor the core drives."""
    spans: list[tuple[float, float]] = []
    start_batch = core.executor.execute_model_async

    def started(sched):
        pending = start_batch(sched)
        began = time.perf_counter()

        class Timed:
            def result(self, timeout=None):
                out = pending.result(timeout)
                spans.append((began, time.perf_counter()))
                return out
        return Timed()
    core.executor.execute_model_async = started
    return spans


def _overlap(spans: list[tuple[float, float]]) -> dict[str, float]:
    events = sorted([(s, 1) for s, _ in spans] + [(e, -1) for _, e in spans])
    depth, last, time_at = 0, events[0][0], {}
    for t, delta in events:
        time_at[depth] = time_at.get(depth, 0.0) + t - last
        depth, last = depth + delta, t
    total = sum(time_at.values())
    return {"share_two_in_flight": sum(v for d, v in time_at.items() if d >= 2) / total,
            "share_one_in_flight": time_at.get(1, 0.0) / total, "batches": len(spans)}


def child(payload: str) -> None:
    from pagedserve import LLM, SamplingParams
    from pagedserve.frontend.bench.datasets import w1
    cfg = json.loads(payload)
    reqs = w1(cfg["num_requests"])
    prompts = [{"prompt_token_ids": r.prompt} for r in reqs]
    params = [SamplingParams(temperature=0.0, max_tokens=r.expected_output_len, ignore_eos=True) for r in reqs]
    with LLM(cfg["model"], dtype="bfloat16", max_model_len=1024, enable_prefix_caching=False,
             **CONFIGS[cfg["name"]]) as llm:
        spans = _timeline(llm.engine) if cfg["name"] == "pp2" else None
        llm.generate(prompts[:2], [SamplingParams(max_tokens=4)] * 2, use_tqdm=False)      # warm-up
        if spans is not None:
            spans.clear()
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        seconds = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {"config": cfg["name"], "output_tokens": tokens, "seconds": seconds,
              "output_tok_per_s": tokens / seconds}
    if spans:
        result["timeline"] = _overlap(spans)
    report(result)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="/tmp/pp_bench_135m")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--result-file", default=None)
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child)
        return
    if not os.path.exists(os.path.join(args.model, "config.json")):
        import torch
        from pagedserve.tests.helpers.tiny_models import make_tiny_model
        make_tiny_model(args.model, arch="llama", tokenizer="synthetic", dtype=torch.bfloat16, hidden_size=576,
                        num_hidden_layers=30, num_attention_heads=8, num_key_value_heads=4, intermediate_size=1536,
                        vocab_size=49152, max_position_embeddings=2048, tie_word_embeddings=True,
                        initializer_range=0.02)
    cores = os.cpu_count() or 1
    for repeat in range(args.repeats):
        for name in CONFIGS:
            threads = cores if name == "tp1" else max(1, cores // 2)
            payload = json.dumps({"name": name, "num_requests": args.num_requests, "model": args.model})
            result = run_child(__file__, payload, threads, name)
            result.update(repeat=repeat, threads_per_process=threads, num_requests=args.num_requests,
                          date=time.strftime("%Y-%m-%dT%H:%M:%S"), command=" ".join(sys.argv))
            emit(result, args.result_file)


if __name__ == "__main__":
    main()
