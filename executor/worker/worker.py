"""A worker: one device (or CPU rank), its model shard and its KV cache."""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

import torch

from pagedserve.common import envs
from pagedserve.common.config.engine_args import EngineConfig
from pagedserve.executor.worker.extension import checked_result, extend
from pagedserve.executor.worker.model_runner import ModelRunner
from pagedserve.executor.worker.step_output import PendingStep
from pagedserve.executor.worker.rl.weight_updates import WorkerRL
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup
from pagedserve.ipc.messages import ModelRunnerOutput, SchedulerOutput
from pagedserve.kernels.attention.kv_quant import check_fp8_kv_device, kv_cache_torch_dtype

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class Worker:
    # What an executor may call by name, from a message (WorkerCall) or in process; nothing else is reachable
    # (besides RL_METHODS, answered by the worker's WorkerRL, and a worker_extension_cls's methods).
    REMOTE_METHODS: ClassVar[frozenset[str]] = frozenset({"determine_num_blocks", "initialize_cache", "ping",
                                                               "add_lora", "remove_lora"})
    RL_METHODS: ClassVar[frozenset[str]] = WorkerRL.METHODS
    EXTENSION_METHODS: ClassVar[frozenset[str]] = frozenset()

    def __init__(self, config: EngineConfig, rank: int = 0, distributed_init_method: str | None = None) -> None:
        self.config = config
        self.rank = rank
        tp_size, pp_size = config.parallel.tensor_parallel_size, config.parallel.pipeline_parallel_size
        self.tp = TPGroup(rank=rank % tp_size, size=tp_size)
        self.pp = PPGroup(rank=rank // tp_size, size=pp_size, tp_size=tp_size, tp_rank=rank % tp_size)
        self.distributed_init_method = distributed_init_method
        self.device = torch.device(config.model.device)
        self.dtype = _DTYPES[config.model.dtype]
        self.kv_dtype = kv_cache_torch_dtype(config.cache.cache_dtype, self.dtype)
        self.runner: ModelRunner | None = None
        self.rl = WorkerRL(self)

    def init_device(self) -> None:
        if self.device.type == "cuda":
            local_rank = envs.LOCAL_RANK if envs.LOCAL_RANK is not None else self.rank   # set by torchrun on every node
            self.device = torch.device("cuda", local_rank % max(torch.cuda.device_count(), 1))
            torch.cuda.set_device(self.device)
        if self.config.cache.cache_dtype == "fp8":
            check_fp8_kv_device(self.device)
        world = self.config.parallel.world_size
        if world > 1 and not torch.distributed.is_initialized():
            import torch.distributed as dist
            backend = "nccl" if self.device.type == "cuda" else "gloo"
            dist.init_process_group(backend, init_method=self.distributed_init_method, world_size=world,
                                    rank=self.rank)
        if self.pp.size > 1 and self.tp.size > 1:
            self.tp = TPGroup(rank=self.tp.rank, size=self.tp.size, group=self._stage_group())
        torch.manual_seed(self.config.model.seed)

    def _stage_group(self) -> object:
        """This stage's ranks as a torch.distributed group: every rank creates every stage's group, in order."""
        import torch.distributed as dist
        tp = self.tp.size
        groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(self.pp.size)]
        return groups[self.pp.rank]

    def bind_thread(self) -> None:
        """Make this worker's device current in the calling thread (CUDA's current device is per thread):
        for an executor that runs steps on a thread of its own."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def load_model(self) -> None:
        from pagedserve.executor.model.model_loader import load_model
        model = load_model(self.config.model, self.tp, self.pp, pooling=self.config.pooler is not None)
        draft = None
        if self.config.draft_model is not None:    # sharded with the model's own group, or whole on each rank
            tp = self.tp if self._draft_tp_size > 1 else TPGroup(rank=0, size=1)
            draft = load_model(self.config.draft_model, tp)
        self.runner = ModelRunner(self.config, model, self.device, self.dtype, draft, self.pp)

    @property
    def _draft_tp_size(self) -> int:
        """The ranks a speculative draft model or head shards over: 1 or this model's (config checked it)."""
        spec = self.config.speculative
        return spec.draft_tensor_parallel_size if spec is not None else 1

    def remote_refusal(self, method: str) -> str | None:
        """Why `method` may not be called from another process, or None if it is in REMOTE_METHODS."""
        allowed = self.REMOTE_METHODS | self.RL_METHODS | self.EXTENSION_METHODS
        if method in allowed:
            return None
        return f"worker method {method!r} is not callable remotely (allowed: {', '.join(sorted(allowed))})"

    def call_remote(self, method: str, args: Sequence[Any] = (), kwargs: dict[str, Any] | None = None) -> Any:
        """Worker.<method>(*args, **kwargs) for a method named in REMOTE_METHODS (or RL_METHODS, or the
        extension's); ValueError for any other name, or for a result that is not JSON-able data."""
        if (why := self.remote_refusal(method)) is not None:
            raise ValueError(why)
        target = self.rl if method in self.RL_METHODS else self
        return checked_result(method, getattr(target, method)(*args, **(kwargs or {})))

    def ping(self) -> str:
        return "pong"

    def update_weights(self, weights: list[tuple[str, Any]]) -> int:
        """Checkpoint-named tensors applied all or nothing: a worker extension's in-process entry point (its
        methods run on the Worker), answered by the worker's WorkerRL."""
        return self.rl.update_weights(weights)

    def add_lora(self, int_id: int, path: str, scaling: float) -> int:
        """Load an adapter the engine core checked (common/lora.py); the bytes it holds on this rank."""
        if self.runner is None or self.runner.lora is None:
            raise ValueError("LoRA adapters need enable_lora")
        return self.runner.lora.add_lora(int_id, path, scaling)

    def remove_lora(self, int_id: int) -> None:
        if self.runner is not None and self.runner.lora is not None:
            self.runner.lora.remove_lora(int_id)

    def kv_bytes_per_block(self) -> int:
        """A block's bytes in every layer's cache: the model's, and a speculative draft model's beside it."""
        elem = torch.tensor([], dtype=self.kv_dtype).element_size()      # fp8: 1 byte
        total = 0
        for m, shards in ((self.config.model, self.tp.size), (self.config.draft_model, self._draft_tp_size)):
            if m is not None:
                # this rank's layers: its stage's (a draft runs beside the model: spec refuses pipeline stages)
                layers = len(self.pp.layers(m.num_layers)) if m is self.config.model else m.num_layers
                total += 2 * layers * self.config.cache.block_size * max(1, m.num_kv_heads // shards) \
                    * m.head_dim * elem
        return total

    def determine_num_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_blocks_override is not None:
            return cache.num_blocks_override
        if self.device.type == "cuda":
            return self._profile_gpu_blocks()
        return max(1, int(cache.kv_cache_memory_gib * (1 << 30)) // self.kv_bytes_per_block())

    def _profile_gpu_blocks(self) -> int:
        """What is left of the utilization budget after weights, the peak of the largest mixed step and
        the memory the decode CUDA graphs will hold, measured with a throwaway one-block cache."""
        from pagedserve.executor.worker.profiling import dummy_prefill_batch, peak_step_bytes
        assert self.runner is not None
        sched, cache, model = self.config.scheduler, self.config.cache, self.config.model
        self.runner.initialize_kv_cache(1)
        mixed = peak_step_bytes(self.runner, dummy_prefill_batch(
            sched.max_num_batched_tokens, sched.max_num_seqs, model.max_model_len, cache.block_size))
        graphs = 0
        if not model.enforce_eager:
            # Graph replays keep their own pool, sized by the largest captured decode step.
            graphs = peak_step_bytes(self.runner, dummy_prefill_batch(
                sched.max_num_seqs, sched.max_num_seqs, model.max_model_len, cache.block_size)) + (64 << 20)
        self.runner.initialize_kv_cache(0)
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        budget = int(total * cache.gpu_memory_utilization) - (total - free) - mixed - graphs
        gib = 1 << 30
        logger.info("GPU memory on rank %d: %.2f GiB total, %.2f in use (weights, context, other processes), "
                    "step peak %.2f, CUDA graphs %.2f -> KV cache %.2f GiB", self.rank, total / gib,
                    (total - free) / gib, mixed / gib, graphs / gib, max(budget, 0) / gib)
        if budget < self.kv_bytes_per_block():
            raise ValueError(f"no GPU memory left for the KV cache: gpu_memory_utilization="
                             f"{cache.gpu_memory_utilization} of {total / gib:.1f} GiB, {(total - free) / gib:.2f} "
                             f"GiB in use, step peak {mixed / gib:.2f} GiB; raise --gpu-memory-utilization or "
                             "lower --max-num-batched-tokens / --max-num-seqs")
        return budget // self.kv_bytes_per_block()

    def initialize_cache(self, num_blocks: int) -> None:
        assert self.runner is not None
        self.runner.initialize_kv_cache(num_blocks)
        if self.device.type == "cuda" and not self.config.model.enforce_eager:
            self.runner.capture_cuda_graphs()
        logger.info("KV cache: %d blocks of %d tokens (%s, %.2f GiB) on rank %d", num_blocks,
                    self.config.cache.block_size, str(self.kv_dtype).removeprefix("torch."),
                    num_blocks * self.kv_bytes_per_block() / (1 << 30), self.rank)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        assert self.runner is not None
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        """Let the KV connector's writes in progress finish (a restart then finds them)."""
        if self.runner is not None and self.runner.kv_connector is not None:
            self.runner.kv_connector.close()

    def execute_model_async(self, scheduler_output: SchedulerOutput) -> PendingStep:
        """Queue the step on the device; its output is taken with .result() (async scheduling)."""
        assert self.runner is not None
        return self.runner.launch(scheduler_output)


def worker_class(config: EngineConfig) -> type[Worker]:
    """Worker, or Worker with the configured worker_extension_cls mixed in."""
    return extend(Worker, config.rl.worker_extension_cls)
