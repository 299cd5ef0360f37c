"""Launch pagedserve across torchrun ranks: every rank is a tensor-parallel worker, rank 0 also runs
the engine core and the frontend.

    torchrun --nproc-per-node 2 scripts/torchrun_launch.py --model PATH --prompt "Hello"
    torchrun --nnodes 2 --node-rank R --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 \\
        scripts/torchrun_launch.py --model PATH --prompt "Hello"

Every engine flag of engine-serve is accepted (generated from EngineArgs); torchrun sets the tensor-parallel
size (its world size) and the executor backend. Rank 0 resolves the engine config and sends it to the other
ranks. Prints one JSON line per prompt on rank 0: {"prompt": ..., "token_ids": [...], "text": ...}.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.common.config.arg_utils import dataclass_from, dataclass_parser, setting
from pagedserve.common.config.engine_args import EngineArgs
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.server_args import LOG_LEVELS


@dataclass(frozen=True)
class LaunchArgs:
    """This launcher's own flags (the engine's are EngineArgs)."""
    prompt: tuple[str, ...] = setting((), append=True, help="a text prompt")
    prompt_ids: tuple[str, ...] = setting((), append=True, help="a prompt as comma-separated token ids")
    max_tokens: int = setting(32, help="tokens to generate for each prompt (greedy)")
    log_level: str = setting("warning", choices=LOG_LEVELS, help="log messages of this level and above")


def make_parser() -> argparse.ArgumentParser:
    return dataclass_parser({"engine": EngineArgs, "launch": LaunchArgs}, description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter)


def parse_args(argv: list[str] | None = None) -> tuple[EngineArgs, LaunchArgs]:
    p = make_parser()
    ns = p.parse_args(argv)
    if ns.distributed_executor_backend not in (None, "torchrun"):
        p.error("--distributed-executor-backend: this launcher runs the torchrun backend")
    try:
        engine_args = dataclass_from(ns, EngineArgs, distributed_executor_backend="torchrun")
        engine_args.validate()
    except ValueError as exc:
        p.error(str(exc))
    return engine_args, dataclass_from(ns, LaunchArgs)


def main() -> None:
    engine_args, launch = parse_args()
    logging.basicConfig(level=launch.log_level.upper())
    # Every collective, this process group's included, is bounded by worker_heartbeat_timeout: a stopped or
    # hung rank fails the launch after it instead of hanging it.
    timeout_s = engine_args.resolved_worker_heartbeat_timeout()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo",     # env:// from torchrun
                            timeout=timedelta(seconds=timeout_s))
    try:
        if engine_args.tensor_parallel_size not in (1, dist.get_world_size()):
            raise ValueError(f"--tensor-parallel-size ({engine_args.tensor_parallel_size}) must be torchrun's "
                             f"world size ({dist.get_world_size()}), or left out")
        engine_args = dataclasses.replace(engine_args, tensor_parallel_size=dist.get_world_size())
        if dist.get_rank() == 0:
            _run_frontend(engine_args, launch)
        else:
            from pagedserve.executor.procs.torchrun_executor import serve_torchrun_worker
            serve_torchrun_worker(timeout_s)
        # Tear down together: a rank that destroys its gloo group while a peer still uses it can die in
        # gloo's destructor and fail the job after all the work is done.
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _run_frontend(engine_args: EngineArgs, launch: LaunchArgs) -> None:
    from pagedserve.frontend.offline.llm import LLM
    llm = LLM(**dataclasses.asdict(engine_args))
    prompts: list = list(launch.prompt) + [[int(t) for t in ids.split(",")] for ids in launch.prompt_ids]
    outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=launch.max_tokens), use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        print(json.dumps({"prompt": prompt, "token_ids": out.outputs[0].token_ids, "text": out.outputs[0].text}),
              flush=True)
    llm.shutdown()


if __name__ == "__main__":
    main()
