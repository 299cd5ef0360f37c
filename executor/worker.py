"""A worker: one device (or CPU rank), its model shard and its KV cache."""
from __future__ import annotations

import logging
import os

import torch

from pagedserve.core.config import EngineConfig
from pagedserve.executor.model_runner import ModelRunner
from pagedserve.executor.parallel_state import TPGroup
from pagedserve.ipc.messages import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger(__name__)

DEFAULT_CPU_KV_CACHE_GIB = 2.0
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Worker:
    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        self.tp = TPGroup(rank=rank, size=config.parallel.tensor_parallel_size)
        self.distributed_init_method = distributed_init_method
        self.device = torch.device(config.model.device)
        self.dtype = _DTYPES[config.model.dtype]
        self.runner: ModelRunner | None = None

    def init_device(self) -> None:
        if self.device.type == "cuda":
            local_rank = int(os.environ.get("LOCAL_RANK", self.rank))   # set by torchrun on every node
            self.device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(self.device)
        if self.tp.size > 1 and not torch.distributed.is_initialized():
            import torch.distributed as dist
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=self.distributed_init_method,
                                    world_size=self.tp.size, rank=self.rank)
        torch.manual_seed(self.config.model.seed)

    def load_model(self) -> None:
        from pagedserve.executor.model_loader import load_model
        model = load_model(self.config.model, self.tp)
        self.runner = ModelRunner(self.config, model, self.device, self.dtype)

    def ping(self) -> str:
        return "pong"

    def kv_bytes_per_block(self) -> int:
        m = self.config.model
        kv_heads = max(1, m.num_kv_heads // self.tp.size)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        return 2 * m.num_layers * self.config.cache.block_size * kv_heads * m.head_dim * elem

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        if self.device.type == "cuda":
            return self._profile_gpu_blocks()
        gib = cache.kv_cache_memory_gib or DEFAULT_CPU_KV_CACHE_GIB
        return max(1, int(gib * (1 << 30)) // self.kv_bytes_per_block())

    def _profile_gpu_blocks(self) -> int:
        # Hook for GPU memory profiling: what is left of the utilization budget after the weights.
        # The GPU issue replaces this with a profiling forward pass at the largest batch.
        free, total = torch.cuda.mem_get_info(self.device)
        budget = total * self.config.cache.gpu_memory_utilization - (total - free)
        return max(1, int(budget * 0.9) // self.kv_bytes_per_block())

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.runner is not None
        self.runner.initialize_kv_cache(num_blocks)
        logger.info("KV cache: %d blocks of %d tokens (%.2f GiB) on rank %d", num_blocks,
                    self.config.cache.block_size, num_blocks * self.kv_bytes_per_block() / (1 << 30), self.rank)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        return self.runner.execute_model(scheduler_output)
