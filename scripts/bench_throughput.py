"""Offline throughput: pagedserve vs HF transformers static batches, in one run.

W1 (CPU): 64 requests from random.Random(0); per request L = randint(32, 512) prompt ids in [100, 49000),
max_tokens = randint(32, 256), ignore_eos, all submitted at once.
G1 (GPU): 256 requests from random.Random(0); prompt length and max_tokens each randint(100, 1024),
prompt ids in [100, 49000), ignore_eos, all at once; on a Qwen3-0.6B-shaped random-weight model
(`--make-qwen3-0.6b` writes one to --model when the folder does not exist), or on an OLMoE-1B-7B-shaped
mixture of experts (`--make-moe-olmoe-shape`).
Each engine runs in its own subprocess so that peak memory (max RSS) is its own.

    python scripts/bench_throughput.py --dtype float32 --engines pagedserve,hf --out benchmarks/throughput_cpu.md
    python scripts/bench_throughput.py --workload g1 --model /tmp/qwen3-0.6b --make-qwen3-0.6b \
        --max-num-seqs 256 --max-num-batched-tokens 8192 --max-model-len 2048 --hf-batch 128
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from collections import defaultdict
from contextlib import contextmanager

from bench_report import emit  # scripts/ is on sys.path when a script runs


def random_workload(num_requests: int, prompt_lens: tuple[int, int], max_tokens: tuple[int, int],
                    seed: int = 0) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    reqs = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_lens)
        prompt = [rng.randrange(100, 49000) for _ in range(length)]
        reqs.append((prompt, rng.randint(*max_tokens)))
    return reqs


def workload_w1(num_requests: int = 64, seed: int = 0) -> list[tuple[list[int], int]]:
    return random_workload(num_requests, (32, 512), (32, 256), seed)


def workload_g1(num_requests: int = 256, seed: int = 0) -> list[tuple[list[int], int]]:
    return random_workload(num_requests, (100, 1024), (100, 1024), seed)


def workload(args: argparse.Namespace) -> list[tuple[list[int], int]]:
    return (workload_w1 if args.workload == "w1" else workload_g1)(args.num_requests)


def make_qwen3_06b(path: str) -> None:
    """Random bf16 weights in Qwen3-0.6B's shape (nothing can be downloaded on the GPU machines)."""
    import torch

    from pagedserve.tests.helpers.tiny_models import make_tiny_model
    make_tiny_model(path, arch="qwen3", tokenizer="synthetic", dtype=torch.bfloat16, hidden_size=1024,
                    num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
                    intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960,
                    rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02,
                    bos_token_id=1, eos_token_id=2)


# OLMoE-1B-7B's shape (64 experts, top 8, 16 layers; ~6.9B weights, ~1.3B active) as a Qwen3-MoE model, which
# differs from OLMoE only in details that do not change the work (q/k norm per head, not over the whole row).
OLMOE_SHAPE = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16,
                   head_dim=128, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024,
                   norm_topk_prob=False, intermediate_size=1024, vocab_size=50304, max_position_embeddings=4096,
                   rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False, initializer_range=0.02,
                   bos_token_id=1, eos_token_id=2)


def make_moe_olmoe_shape(path: str) -> None:
    """Random bf16 weights in OLMoE-1B-7B's shape, as a Qwen3MoeForCausalLM checkpoint (per-expert tensors)."""
    import torch

    from pagedserve.tests.helpers.tiny_models import make_tiny_model
    make_tiny_model(path, arch="qwen3_moe", tokenizer="synthetic", dtype=torch.bfloat16, **OLMOE_SHAPE)


class StepProfile:
    """Wall time per engine phase, gathered by wrapping the phase functions (benchmark-only)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.steps = 0

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start

    def wrap(self, obj: object, attr: str, name: str) -> None:
        fn = getattr(obj, attr)

        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        setattr(obj, attr, timed)


def run_pagedserve(args: argparse.Namespace) -> dict:
    import torch
    from pagedserve import LLM, SamplingParams
    import pagedserve.executor.worker.model_runner as mr

    reqs = workload(args)
    llm = LLM(args.model, dtype=args.dtype, max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens, multiprocess_core=args.multiprocess_core,
              tensor_parallel_size=args.tp, device=args.device, max_model_len=args.max_model_len,
              gpu_memory_utilization=args.gpu_memory_utilization, enforce_eager=args.enforce_eager)
    if llm.engine is None or args.tp > 1:
        return _timed_generate(llm, reqs, args, SamplingParams, {})
    prof = StepProfile()
    runner = llm.engine.executor.worker.runner
    core = llm.engine
    prof.wrap(core.scheduler, "schedule", "schedule")
    prof.wrap(core.scheduler, "update_from_output", "update")
    prof.wrap(mr, "prepare_inputs", "prepare_inputs")
    prof.wrap(mr, "build_sampling_metadata", "sampling_metadata")
    prof.wrap(runner.model, "forward", "model_forward")
    prof.wrap(runner.model, "compute_logits", "lm_head")
    prof.wrap(runner, "sampler", "sampler")
    prof.wrap(llm.output_processor, "process_outputs", "detokenize")
    prof.wrap(core, "step", "step_total")
    result = _timed_generate(llm, reqs, args, SamplingParams, prof.seconds)   # filled in during the run
    result["preemptions"] = core.scheduler.num_preemptions
    return result


def _timed_generate(llm, reqs, args: argparse.Namespace, SamplingParams, profile: dict) -> dict:
    import torch
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    prompts = [p for p, _ in reqs]
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    if tokens != sum(m for _, m in reqs):
        raise RuntimeError("pagedserve returned the wrong number of tokens")
    name = "pagedserve" + (" (core process)" if args.multiprocess_core else "") + \
        (f" TP={args.tp}" if args.tp > 1 else "") + (" eager" if args.enforce_eager else "")
    result = {"engine": name, "seconds": elapsed, "output_tokens": tokens, "threads": torch.get_num_threads()}
    if profile:
        result["profile"] = {k: round(v, 3) for k, v in sorted(profile.items())}
    llm.shutdown()
    return result


def load_hf_model(model_path: str | None, dtype_name: str, device_arg: str):
    """HF transformers' own model for `model_path` (a .gguf is dequantized by transformers), in eval mode,
    with EOS turned off so that every generate runs its full length (ignore_eos). Returns (model, device)."""
    import torch
    from transformers import AutoModelForCausalLM
    from pagedserve.common.model_files import resolve_model

    source = resolve_model(model_path)
    dtype = getattr(torch, dtype_name)
    if source.format == "gguf":
        model = AutoModelForCausalLM.from_pretrained(os.path.dirname(source.path),
                                                     gguf_file=os.path.basename(source.path), dtype=dtype)
    else:
        model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype)
    device = "cuda" if device_arg != "cpu" and torch.cuda.is_available() else "cpu"
    model.to(device).eval()
    model.generation_config.eos_token_id = None
    return model, device


def hf_static_generate(model, device: str, reqs: list[tuple[list[int], int]], batch_size: int) -> int:
    """Runs `reqs` in static batches of `batch_size` (left-padded, each batch as long as its longest
    max_tokens); returns the requested output tokens, the only ones that count."""
    import torch
    pad = 0
    tokens = 0
    with torch.inference_mode():
        for i in range(0, len(reqs), batch_size):
            batch = reqs[i:i + batch_size]
            width = max(len(p) for p, _ in batch)
            ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in batch], device=device)
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
            longest = max(m for _, m in batch)
            model.generate(ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
                           do_sample=False, pad_token_id=pad)
            tokens += sum(m for _, m in batch)
    if device == "cuda":
        torch.cuda.synchronize()
    return tokens


def run_hf(args: argparse.Namespace) -> dict:
    import torch
    model, device = load_hf_model(args.model, args.dtype, args.device)
    reqs = workload(args)
    start = time.perf_counter()
    tokens = hf_static_generate(model, device, reqs, args.hf_batch)
    elapsed = time.perf_counter() - start
    return {"engine": f"hf-static-{args.hf_batch}", "seconds": elapsed, "output_tokens": tokens,
            "threads": torch.get_num_threads()}


def child_main(args: argparse.Namespace) -> None:
    result = run_pagedserve(args) if args.child == "pagedserve" else run_hf(args)
    result["peak_rss_mib"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    result["tok_per_s"] = result["output_tokens"] / result["seconds"]
    print("RESULT " + json.dumps(result), flush=True)


def parent_main(args: argparse.Namespace) -> None:
    if args.make_qwen3_06b and not os.path.isdir(args.model or ""):
        if not args.model:
            sys.exit("--make-qwen3-0.6b needs --model PATH")
        make_qwen3_06b(args.model)
    if args.make_moe_olmoe_shape and not os.path.isdir(args.model or ""):
        if not args.model:
            sys.exit("--make-moe-olmoe-shape needs --model PATH")
        make_moe_olmoe_shape(args.model)
    results = []
    for engine in args.engines.split(","):
        # Variants of the multi-process path: pagedserve-mp (engine core process), pagedserve-tpN.
        extra = ["--multiprocess-core"] if engine == "pagedserve-mp" else []
        if engine == "pagedserve-eager":
            extra = ["--enforce-eager"]
        if engine.startswith("pagedserve-tp"):
            extra = ["--tp", engine[len("pagedserve-tp"):]]
        child = "hf" if engine == "hf" else "pagedserve"
        cmd = [sys.executable, __file__, "--child", child] + _forward_args(args) + extra
        proc = subprocess.run(cmd, capture_output=True, text=True)
        lines = [l for l in proc.stdout.splitlines() if l.startswith("RESULT ")]
        if proc.returncode or not lines:
            sys.exit(f"{engine} failed:\n{proc.stderr[-4000:]}")
        results.append(json.loads(lines[-1][len("RESULT "):]))
        print(json.dumps(results[-1]), flush=True)
    table = format_table(args, results)
    emit(table, args.out)


def _forward_args(args: argparse.Namespace) -> list[str]:
    out = ["--dtype", args.dtype, "--num-requests", str(args.num_requests), "--hf-batch", str(args.hf_batch),
           "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
           "--workload", args.workload, "--device", args.device,
           "--gpu-memory-utilization", str(args.gpu_memory_utilization)]
    out += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    return out + (["--model", args.model] if args.model else [])


def format_table(args: argparse.Namespace, results: list[dict]) -> str:
    base = next((r for r in results if r["engine"].startswith("hf")), None)
    lines = [f"\n### {args.workload.upper()}, {args.num_requests} requests, dtype {args.dtype} "
             f"({time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} cores, "
             f"torch threads {results[0].get('threads')})\n",
             "| engine | output tokens | seconds | output tok/s | vs HF | peak RSS MiB |",
             "|---|---|---|---|---|---|"]
    for r in results:
        ratio = f"{r['tok_per_s'] / base['tok_per_s']:.2f}x" if base else "-"
        lines.append(f"| {r['engine']} | {r['output_tokens']} | {r['seconds']:.1f} | {r['tok_per_s']:.1f} | "
                     f"{ratio} | {r['peak_rss_mib']:.0f} |")
    for r in results:
        if "profile" in r:
            lines.append(f"\n{r['engine']} step-time breakdown (s): {json.dumps(r['profile'])}; "
                         f"preemptions: {r['preemptions']}")
    return "\n".join(lines)


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--workload", default="w1", choices=["w1", "g1"])
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--enforce-eager", action="store_true")
    p.add_argument("--make-qwen3-0.6b", dest="make_qwen3_06b", action="store_true",
                   help="write a Qwen3-0.6B-shaped random-weight model to --model if it does not exist")
    p.add_argument("--make-moe-olmoe-shape", action="store_true",
                   help="write an OLMoE-1B-7B-shaped random-weight Qwen3-MoE model to --model if it does not exist")
    p.add_argument("--engines", default="pagedserve,hf",
                   help="comma-separated: pagedserve, pagedserve-mp, pagedserve-tp2, pagedserve-eager, hf")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--hf-batch", type=int, default=16)
    p.add_argument("--max-num-seqs", type=int, default=128)
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--multiprocess-core", action="store_true", help="run the engine core in its own process")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel worker processes")
    p.add_argument("--out", default=None, help="append the result table to this markdown file")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p.parse_args()


if __name__ == "__main__":
    ns = parse_args()
    child_main(ns) if ns.child else parent_main(ns)
