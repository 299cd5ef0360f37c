"""W1-like offline throughput on a tiny random mixture-of-experts model (CPU, grouped reference path), and where
the step time goes: router, expert sort, expert GEMMs, shared expert, attention (projections + paged kernel),
LM head, sampler, the rest of the engine.

W1 (see bench_throughput.py): 64 requests from random.Random(0), prompt 32-512 random ids in [100, 49000),
max_tokens 32-256, ignore_eos, all at once. --num-requests / --prompt-len / --max-tokens shrink it for a
quick run; the model is Qwen3-MoE- or Qwen2-MoE-shaped (tiny by default, 49152-id vocabulary for W1's ids).

    python scripts/bench_moe_cpu.py --model /tmp/tiny-moe --threads 1 --num-requests 4 --prompt-len 32,64 \
        --max-tokens 8,16 --out benchmarks/moe_cpu.md
"""
from __future__ import annotations

import argparse
import os
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager

from bench_report import emit  # scripts/ is on sys.path when a script runs
from bench_throughput import random_workload


class Timers:
    """Wall seconds per named phase, by wrapping functions and methods (benchmark-only, no nesting rules:
    an inner phase's time also counts in its outer phase)."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] += time.perf_counter() - start
            self.calls[name] += 1

    def wrap(self, owner: object, attr: str, name: str) -> None:
        fn: Callable = getattr(owner, attr)

        def timed(*args, **kwargs):
            with self.phase(name):
                return fn(*args, **kwargs)
        setattr(owner, attr, timed)


def make_model(path: str, arch: str, layers: int, hidden: int, experts: int, top_k: int, inter: int) -> None:
    import torch

    from pagedserve.tests.helpers.tiny_models import make_tiny_model
    shape = dict(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                 num_key_value_heads=max(1, hidden // 128), vocab_size=49152, max_position_embeddings=1024,
                 num_experts=experts, num_experts_per_tok=top_k, moe_intermediate_size=inter,
                 intermediate_size=4 * inter, initializer_range=0.02)
    if arch == "qwen2_moe":
        shape["shared_expert_intermediate_size"] = 4 * inter
    else:
        shape["norm_topk_prob"] = True
    make_tiny_model(path, arch=arch, tokenizer="synthetic", dtype=torch.float32, **shape)


def instrument(timers: Timers, llm) -> None:
    import pagedserve.executor.model.layers.fused_moe as fused_moe
    import pagedserve.executor.model.models.llama as llama
    import pagedserve.executor.model.models.qwen_moe as qwen_moe
    from pagedserve.executor.model.layers.attention import PagedAttention
    from pagedserve.kernels import torch_moe, ops

    runner = llm.engine.executor.worker.runner
    timers.wrap(fused_moe.Router, "forward", "router: gate linears (and the shared-expert gate)")
    timers.wrap(ops, "topk_softmax", "router: softmax + top-k")
    timers.wrap(torch_moe, "sort_by_expert", "experts: sort by expert")
    timers.wrap(ops, "fused_moe", "experts: grouped GEMMs (incl. sort, weighted sum)")
    timers.wrap(qwen_moe.SharedExpertMLP, "forward", "shared expert")
    timers.wrap(llama.LlamaAttention, "forward", "attention: block (qkv, rope, kernel, o_proj)")
    timers.wrap(PagedAttention, "forward", "attention: paged kernel + cache write")
    timers.wrap(runner.model, "forward", "model forward")
    timers.wrap(runner.model, "compute_logits", "lm head")
    timers.wrap(runner, "sampler", "sampler")
    timers.wrap(llm.engine, "step", "engine step")


def run(args: argparse.Namespace) -> str:
    import torch

    from pagedserve import LLM, SamplingParams
    if args.threads:
        torch.set_num_threads(args.threads)        # this process only: a benchmark's own setting
    if not os.path.isdir(args.model):
        make_model(args.model, args.arch, args.layers, args.hidden, args.experts, args.top_k, args.inter)
    reqs = random_workload(args.num_requests, args.prompt_len, args.max_tokens)
    llm = LLM(args.model, dtype="float32", max_num_seqs=args.max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens)
    timers = Timers()
    instrument(timers, llm)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for _, m in reqs]
    start = time.perf_counter()
    outs = llm.generate([p for p, _ in reqs], params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    llm.shutdown()
    return report(args, timers, elapsed, tokens, sum(len(p) for p, _ in reqs), torch.get_num_threads())


def report(args: argparse.Namespace, timers: Timers, elapsed: float, tokens: int, prompt_tokens: int,
           threads: int) -> str:
    step = timers.seconds["engine step"]
    lines = [f"\n### Tiny {args.arch} ({args.layers} layers, hidden {args.hidden}, {args.experts} experts top-"
             f"{args.top_k}, expert intermediate {args.inter}), CPU reference path, {threads} thread(s)",
             f"{args.num_requests} requests, prompt {args.prompt_len[0]}-{args.prompt_len[1]}, max_tokens "
             f"{args.max_tokens[0]}-{args.max_tokens[1]}: {tokens} output tokens ({prompt_tokens} prompt) in "
             f"{elapsed:.2f} s = {tokens / elapsed:.1f} output tok/s", "",
             "| phase | seconds | % of engine step time | calls |", "|---|---:|---:|---:|"]
    for name, seconds in sorted(timers.seconds.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {name} | {seconds:.3f} | {100 * seconds / step:.1f} | {timers.calls[name]} |")
    lines.append("\nPhases nest (the attention kernel is inside the attention block, both inside model forward; "
                 "the sort is inside the grouped GEMMs).")
    return "\n".join(lines)


def pair(text: str) -> tuple[int, int]:
    lo, hi = (int(v) for v in text.split(","))
    if not 0 < lo <= hi:
        raise argparse.ArgumentTypeError(f"expected LO,HI with 0 < LO <= HI, got {text!r}")
    return lo, hi


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", required=True, help="model folder; a tiny random MoE is written if absent")
    parser.add_argument("--arch", choices=("qwen3_moe", "qwen2_moe"), default="qwen3_moe")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--inter", type=int, default=128, help="each expert's intermediate size")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--prompt-len", type=pair, default=(32, 512))
    parser.add_argument("--max-tokens", type=pair, default=(32, 256))
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--max-num-batched-tokens", type=int, default=512)
    parser.add_argument("--threads", type=int, default=0, help="torch threads for this run (0: torch's default)")
    parser.add_argument("--out", default=None, help="append the markdown report to this file")
    args = parser.parse_args()
    emit(run(args), args.out)


if __name__ == "__main__":
    main()
