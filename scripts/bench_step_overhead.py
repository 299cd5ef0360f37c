"""Per-step host overhead: what an engine step costs besides the model's own compute.

    python scripts/bench_step_overhead.py --out benchmarks/step_overhead_cpu.md

A random Llama with 2 layers of width 64 makes the forward nearly free, so what remains of a step is the
work every step pays on any device: scheduling, the workers' persistent-batch update, input preparation
and staging, sampling metadata and sampler, the scheduler update, and the offline output processing
(incremental detokenization). On a GPU this work either adds to the step or has to hide behind it, so it
is measured here, per step, for batches of 1 and 64 decoding requests (greedy, ignore_eos).
`--cprofile` adds the top functions by own time.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import os
import platform
import pstats
import tempfile
import time

from bench_report import emit  # scripts/ is on sys.path when a script runs
from bench_throughput import StepProfile

from pagedserve.tests.helpers.tiny_models import make_tiny_model

PHASES = ("schedule", "update_states", "prepare_inputs", "stage_inputs", "model_forward", "lm_head",
          "sampling_metadata", "sampler", "scheduler_update", "stats", "detokenize")


def instrument(llm) -> tuple[StepProfile, list[int]]:
    import pagedserve.executor.worker.model_runner as mr
    prof, steps = StepProfile(), [0]
    core = llm.engine
    runner = core.executor.worker.runner
    prof.wrap(core.scheduler, "schedule", "schedule")
    prof.wrap(core.scheduler, "update_from_output", "scheduler_update")
    prof.wrap(core.scheduler, "make_stats", "stats")
    prof.wrap(runner, "_update_states", "update_states")
    prof.wrap(mr, "prepare_inputs", "prepare_inputs")
    prof.wrap(runner.buffers, "commit", "stage_inputs")
    prof.wrap(mr, "build_sampling_metadata", "sampling_metadata")
    prof.wrap(runner.model, "forward", "model_forward")
    prof.wrap(runner.model, "compute_logits", "lm_head")
    prof.wrap(runner, "sampler", "sampler")
    prof.wrap(llm.output_processor, "process_outputs", "detokenize")
    step = core.step

    def counted():
        steps[0] += 1
        return step()
    core.step = counted
    prof.wrap(core, "step", "step_total")
    return prof, steps


def measure(llm, batch: int, tokens: int, use_cprofile: bool) -> tuple[dict, int, float, str]:
    from pagedserve import SamplingParams
    prompts = [[10 + i, 11, 12, 13, 14, 15, 16, 17] for i in range(batch)]
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    llm.generate(prompts, params, use_tqdm=False)          # warm-up: first-call costs stay out
    prof, steps = instrument(llm)
    profiler = cProfile.Profile() if use_cprofile else None
    start = time.perf_counter()
    if profiler:
        profiler.enable()
    llm.generate(prompts, params, use_tqdm=False)
    if profiler:
        profiler.disable()
    wall = time.perf_counter() - start
    top = ""
    if profiler:
        buf = io.StringIO()
        pstats.Stats(profiler, stream=buf).sort_stats("tottime").print_stats(15)
        top = buf.getvalue()
    return dict(prof.seconds), steps[0], wall, top


def format_rows(batch: int, seconds: dict, steps: int, wall: float) -> list[str]:
    us = {k: v / steps * 1e6 for k, v in seconds.items()}
    inside = sum(us.get(p, 0.0) for p in PHASES if p not in ("detokenize",))
    other = us["step_total"] - inside
    cells = [f"{us.get(p, 0.0):.0f}" for p in PHASES]
    host = wall / steps * 1e6 - us.get("model_forward", 0.0)
    return [f"| {batch} | {steps} | {wall / steps * 1e6:.0f} | " + " | ".join(cells) + f" | {other:.0f} | {host:.0f} |"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", default="1,64")
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--cprofile", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    import torch
    from pagedserve import LLM
    path = make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="ps-overhead-"), "tiny"))
    llm = LLM(path, dtype="float32", device="cpu", max_num_seqs=128, kv_cache_memory=0.25)
    when = time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())
    lines = [f"\n### Host work per step, tiny model (2 layers, hidden 64), {when}, {platform.machine()}, "
             f"{os.cpu_count()} cores, torch {torch.__version__}, threads {torch.get_num_threads()}\n",
             "µs per step; `other` = the rest of `EngineCore.step`; `host` = wall per step minus the forward.\n",
             "| batch | steps | wall | " + " | ".join(PHASES) + " | other | host |",
             "|---" * (len(PHASES) + 5) + "|"]
    profiles = []
    for batch in [int(b) for b in args.batches.split(",")]:
        seconds, steps, wall, top = measure(llm, batch, args.tokens, args.cprofile)
        lines += format_rows(batch, seconds, steps, wall)
        print(lines[-1], flush=True)
        if top:
            profiles.append(f"\ncProfile, batch {batch} (top 15 by own time):\n\n```\n{top.strip()}\n```")
    llm.shutdown()
    table = "\n".join(lines + profiles)
    emit(table, args.out)


if __name__ == "__main__":
    main()
