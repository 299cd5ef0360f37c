"""Weight updates against restarts (issue 30): how long a running engine (its core in its own process, as a
server runs it) takes to take new weights from a trainer over a gloo group, to reload them from disk, and to
wake from sleep, against a restart of the same engine (shut down, start, load). One JSON line per measurement
in --result-file, with the command.

    PYTHONPATH=... python scripts/bench_weight_update.py --result-file benchmarks/results/weight_update.jsonl
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time
from typing import Any

import torch

from pagedserve.executor.worker.rl.weight_sync import WeightSyncGroup
from pagedserve.frontend.offline.llm import LLM
from pagedserve.tests.helpers.server import free_port
from pagedserve.tests.helpers.tiny_models import make_tiny_model

# ~92M parameters (368 MB in float32): big enough that loading dominates start-up, small enough for CI machines.
MODEL = dict(hidden_size=768, num_hidden_layers=6, num_attention_heads=12, num_key_value_heads=4,
             intermediate_size=2048, vocab_size=32768)


def trainer(path: str, port: int, world: int, rounds: int, meta_out: Any) -> None:
    """Rank 0: loads the checkpoint's tensors and broadcasts them all, `rounds` times."""
    from safetensors.torch import load_file
    tensors = sorted(load_file(os.path.join(path, "model.safetensors")).items())
    group = WeightSyncGroup("127.0.0.1", port, 0, world)
    meta_out.put(([n for n, _ in tensors], [str(t.dtype) for _, t in tensors], [list(t.shape) for _, t in tensors]))
    for _ in range(rounds):
        for _, t in tensors:
            group.broadcast(t, src=0)


def timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--result-file", default="benchmarks/results/weight_update.jsonl")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    args = ap.parse_args()
    tp, rows = args.tensor_parallel_size, []
    path = make_tiny_model(os.path.join(tempfile.mkdtemp(prefix="bench-wu-"), "m"), **MODEL)
    engine_args = dict(dtype="float32", tensor_parallel_size=tp, enable_sleep_mode=True, kv_cache_memory=0.5)

    def record(name: str, seconds: list[float]) -> None:
        rows.append({"measure": name, "seconds": seconds, "median_s": sorted(seconds)[len(seconds) // 2]})
        print(f"{name:28s} median {rows[-1]['median_s']:.3f} s  {[round(s, 3) for s in seconds]}", flush=True)

    # A server's restart starts a new engine core process (imports, load, KV cache); an LLM in a process that
    # has everything imported already restarts faster: both are measured.
    for name, in_process in (("restart_new_core_process", False), ("restart_in_process", True)):
        record(name, [timed(lambda: LLM(path, multiprocess_core=not in_process, **engine_args).shutdown())
                      for _ in range(args.rounds)])

    llm = LLM(path, multiprocess_core=True, **engine_args)
    ctx = mp.get_context("spawn")
    meta, port = ctx.Queue(), free_port()
    proc = ctx.Process(target=trainer, args=(path, port, 1 + tp, args.rounds, meta))
    proc.start()
    llm.collective_rpc("init_weight_update_group", args=("127.0.0.1", port, 1, 1 + tp))
    names, dtypes, shapes = meta.get(timeout=120)
    record("push_over_gloo", [timed(lambda: llm.collective_rpc("update_weights_from_distributed",
                                                                args=(names, dtypes, shapes)))
                              for _ in range(args.rounds)])
    proc.join(60)
    record("reload_weights_from_disk", [timed(llm.reload_weights) for _ in range(args.rounds)])
    wake1, wake2 = [], []
    for _ in range(args.rounds):
        llm.sleep(level=1)
        wake1.append(timed(llm.wake_up))
        llm.sleep(level=2)
        wake2.append(timed(lambda: (llm.wake_up(), llm.reload_weights())))
    record("wake_up_level1", wake1)
    record("wake_up_level2_and_reload", wake2)
    llm.shutdown()
    stamp = time.strftime("%Y-%m-%dT%H:%M:%S")
    command = " ".join(["scripts/bench_weight_update.py", *sys.argv[1:]])
    with open(args.result_file, "a") as f:
        for row in rows:
            f.write(json.dumps({**row, "tensor_parallel_size": tp, "params_m": round(sum(
                torch.Size(s).numel() for s in shapes) / 1e6, 1), "threads": torch.get_num_threads(),
                "date": stamp, "command": command}) + "\n")


if __name__ == "__main__":
    main()
