"""Single-request decode on GPU against the weight-bandwidth bound.

    python scripts/bench_decode.py --model /tmp/qwen3-0.6b --out benchmarks/decode_gpu.md

One request (128 prompt tokens, greedy, ignore_eos): the engine's time per output token (the
difference of two runs, 513 and 1 output tokens, divided by 512) and the model's decode step alone
(replay of the 1-row CUDA graph, and the eager forward), against weight bytes / measured bandwidth.
"""
from __future__ import annotations

import argparse
import time

import torch
import triton


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    from pagedserve import LLM, SamplingParams

    src = torch.randn(1 << 28, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    bw = 2 * src.numel() * 2 / (triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median") / 1e3)
    del src, dst
    lines = []
    for eager in (False, True):
        llm = LLM(args.model, device="cuda", dtype="bfloat16", max_model_len=2048, enforce_eager=eager,
                  gpu_memory_utilization=0.5)
        runner = llm.engine.executor.worker.runner
        weight_bytes = sum(t.numel() * t.element_size() for t in runner.model.parameters())
        prompt = list(range(1000, 1128))
        times = {}
        for n in (1, 513, 1, 513):
            torch.cuda.synchronize()
            start = time.perf_counter()
            llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0), use_tqdm=False)
            times[n] = time.perf_counter() - start                      # second pass of each is kept
        per_token = (times[513] - times[1]) / 512
        floor = weight_bytes / bw
        lines.append(f"| engine step, {'eager' if eager else 'CUDA graphs'} | {per_token * 1e3:.3f} | "
                     f"{floor * 1e3:.3f} | {floor / per_token:.0%} |")
        if not eager:
            ms = triton.testing.do_bench(lambda: runner.graphs.replay(1), return_mode="median")
            lines.append(f"| model forward, 1-row graph replay | {ms:.3f} | {floor * 1e3:.3f} | {floor * 1e3 / ms:.0%} |")
            breakdown = kernel_breakdown(runner)
        llm.shutdown()
        del llm, runner
        torch.cuda.empty_cache()
    props = torch.cuda.get_device_properties(0)
    head = [f"Device {props.name}; torch {torch.__version__}, triton {triton.__version__}; copy bandwidth "
            f"{bw / 1e12:.2f} TB/s (read + write); weights {weight_bytes / 1e9:.3f} GB bf16 (tied lm_head read once).",
            "", "| what | ms per token | weight-bandwidth floor ms | of floor |", "|---|---|---|---|"]
    text = "\n".join(head + lines + ["", "Kernel time in one 1-row decode forward (torch.profiler, eager launches; "
                                      "device time only):", "", "| kernel | calls | µs | share |", "|---|---|---|---|"]
                     + breakdown)
    print(text)
    if args.out:
        with open(args.out, "a") as f:
            f.write(text + "\n\n")


def kernel_breakdown(runner) -> list[str]:
    """Device time per kernel name over one eager decode forward of the 1-row batch the graph uses."""
    from torch.profiler import ProfilerActivity, profile
    view = runner.buffers.decode_view(1)
    with torch.inference_mode():
        for _ in range(3):
            runner.model(view.input_ids, view.positions, view.meta)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            runner.model(view.input_ids, view.positions, view.meta)
            torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for evt in prof.events():
        if evt.device_type.name == "CUDA":
            entry = totals.setdefault(evt.name[:60], [0, 0.0])
            entry[0] += 1
            entry[1] += evt.time_range.elapsed_us()
    grand = sum(t for _, t in totals.values())
    rows = sorted(totals.items(), key=lambda kv: -kv[1][1])[:14]
    out = [f"| {name} | {n} | {t:.0f} | {t / grand:.0%} |" for name, (n, t) in rows]
    return out + [f"| all kernels | {sum(n for n, _ in totals.values())} | {grand:.0f} | 100% |"]


if __name__ == "__main__":
    main()
