"""Launch pagedserve across torchrun ranks: every rank is a tensor-parallel worker, rank 0 also runs
the engine core and the frontend.

    torchrun --nproc-per-node 2 scripts/torchrun_launch.py --model PATH --prompt "Hello"
    torchrun --nnodes 2 --node-rank R --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        scripts/torchrun_launch.py --model PATH --prompt "Hello"

Prints one JSON line per prompt on rank 0: {"prompt": ..., "token_ids": [...], "text": ...}.
"""
from __future__ import annotations

import argparse
import json
import logging
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.common.config import EngineArgs
from pagedserve.common.sampling_params import SamplingParams


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--prompt", action="append", default=[], help="text prompt (repeatable)")
    p.add_argument("--prompt-ids", action="append", default=[], help="comma-separated token ids (repeatable)")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--worker-heartbeat-timeout", type=float, default=300.0,
                   help="seconds a rank may keep the others waiting in a collective; a stopped or hung rank "
                        "fails the launch after this instead of hanging it (allow for start-up skew)")
    p.add_argument("--log-level", default="warning")
    return p.parse_args()


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=args.log_level.upper())
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",     # env:// from torchrun
                            timeout=timedelta(seconds=args.worker_heartbeat_timeout))
    engine_args = dict(model=args.model, dtype=args.dtype, max_model_len=args.max_model_len,
                       tensor_parallel_size=dist.get_world_size(), distributed_executor_backend="torchrun",
                       worker_heartbeat_timeout=args.worker_heartbeat_timeout)
    try:
        if dist.get_rank() == 0:
            _run_frontend(args, engine_args)
        else:
            from pagedserve.executor.procs.torchrun_executor import serve_torchrun_worker
            serve_torchrun_worker(EngineArgs(**engine_args).create_engine_config())
        # Tear down together: a rank that destroys its gloo group while a peer still uses it can die in
        # gloo's destructor and fail the job after all the work is done.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_frontend(args: argparse.Namespace, engine_args: dict) -> None:
    from pagedserve.frontend.llm import LLM
    llm = LLM(**engine_args)
    prompts: list = list(args.prompt) + [[int(t) for t in ids.split(",")] for ids in args.prompt_ids]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=args.max_tokens), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        print(json.dumps({"prompt": prompt, "token_ids": out.outputs[0].token_ids, "text": out.outputs[0].text}),
              flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
