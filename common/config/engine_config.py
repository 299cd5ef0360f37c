"""The frozen configs the engine is built from: everything resolved, no defaults (EngineArgs in config.py
holds the one default of each setting and resolves them into these)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.kv_transfer.config import KVTransferConfig
from pagedserve.common.model.model_files import ModelSource
from pagedserve.common.multimodal.config import MultiModalConfig
from pagedserve.common.pooler_config import PoolerConfig
from pagedserve.common.quantization import QuantSpec
from pagedserve.common.speculative import SpeculativeConfig


@dataclass(frozen=True)
class ModelConfig:
    source: ModelSource
    hf_config: Any = field(repr=False, compare=False)
    dtype: str                      # resolved: "float32" | "bfloat16" | "float16"
    device: str                     # "cpu" | "cuda"
    max_model_len: int
    seed: int
    served_model_name: str
    enforce_eager: bool             # CUDA: no decode graphs
    # CPU: float linears in fixed row blocks, every token's attention alone (--batch-invariant, docs/determinism.md)
    batch_invariant: bool
    tokenizer: str | None           # a local tokenizer folder other than the model's own
    # From generation_config.json (--generation-config): defaults for unset request fields, extra EOS ids.
    default_sampling: dict = field(compare=False)
    generation_eos_token_ids: tuple[int, ...]
    quantization: QuantSpec | None  # resolved from --quantization and the checkpoint; None: float
    # A multimodal checkpoint's whole config (vision tower, projector, placeholder ids); hf_config is then its
    # language model's. None for a text model.
    mm_config: Any = field(repr=False, compare=False)

    @property
    def arch_config(self) -> Any:
        """The config that names the architecture (the model class is built from it)."""
        return self.mm_config if self.mm_config is not None else self.hf_config

    @property
    def num_layers(self) -> int:
        return self.hf_config.num_hidden_layers

    @property
    def num_kv_heads(self) -> int:
        return getattr(self.hf_config, "num_key_value_heads", None) or self.hf_config.num_attention_heads

    @property
    def num_heads(self) -> int:
        return self.hf_config.num_attention_heads

    @property
    def head_dim(self) -> int:
        return getattr(self.hf_config, "head_dim", None) or self.hf_config.hidden_size // self.num_heads

    @property
    def vocab_size(self) -> int:
        return self.hf_config.vocab_size

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = getattr(self.hf_config, "eos_token_id", None)
        ids = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        return tuple(dict.fromkeys(ids + self.generation_eos_token_ids))


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    kv_cache_memory_gib: float                  # the KV cache's size on CPU (CUDA sizes it from memory)
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    num_blocks_override: int | None
    # "auto" (the model dtype) | "bfloat16" | "float32" | "fp8" (e4m3): dtype.resolve_kv_cache_dtype
    cache_dtype: str


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    policy: str                      # "fcfs" | "priority"
    enable_chunked_prefill: bool
    # New requests beyond this many waiting are refused (EngineOverloadedError); None = unbounded.
    max_waiting_requests: int | None
    # Schedule step N+1 while step N runs: requests carry output placeholders until the sampled ids arrive.
    async_scheduling: bool
    # Batches in flight at once (pipeline parallelism: one per stage); a request is never in two of them.
    batch_queue_size: int
    # LoRA adapters one batch may use (0: LoRA off); a request whose adapter finds no room waits, in order.
    max_loras: int


@dataclass(frozen=True)
class ParallelConfig:
    tensor_parallel_size: int
    distributed_executor_backend: str     # one of EXECUTOR_BACKENDS
    # A worker process whose heartbeat thread is silent this long is hung (or SIGSTOPped): the engine
    # fails. The beat comes from its own thread, so a long step does not count against it. Under torchrun
    # it bounds every collective instead.
    worker_heartbeat_timeout_s: float
    # Stages the layers are split over; rank = stage * tensor_parallel_size + its rank within the stage.
    pipeline_parallel_size: int

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass(frozen=True)
class StructuredOutputsConfig:
    reasoning_parser: str | None     # a grammar constrains only the answer after the reasoning's end marker
    compile_timeout_s: float         # a grammar that takes longer to compile fails its request


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int          # adapters in one batch (the slots each LoRA layer holds)
    max_lora_rank: int      # the largest rank an adapter may have
    max_cpu_loras: int      # adapters kept loaded (least recently used beyond this are unloaded)


@dataclass(frozen=True)
class RLConfig:
    """What RL rollouts need from the engine (docs/rl_weight_updates.md)."""
    worker_extension_cls: str | None   # "module.Class" mixed into every worker: its methods join collective_rpc
    enable_sleep_mode: bool            # sleep()/wake_up() allowed
    requests_while_sleeping: str       # "reject" (HTTP 503) or "wait" (queued until wake_up)


@dataclass(frozen=True)
class EngineConfig:
    """Everything resolved: no field has a default (EngineArgs holds the one default of each setting), and
    no process that receives it reads a model file or the Hub to rebuild it (common/config/wire.py)."""
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    parallel: ParallelConfig
    structured_outputs: StructuredOutputsConfig
    speculative: SpeculativeConfig | None     # None: no speculative decoding
    draft_model: ModelConfig | None           # speculative_config's draft model, resolved like the model
    lora: LoRAConfig | None                   # None: no adapters (enable_lora off)
    pooler: PoolerConfig | None               # --runner pooling: how prompts become vectors; None: generate
    rl: RLConfig                              # worker extension, sleep mode
    multimodal: MultiModalConfig | None       # None: a text model
    kv_transfer: KVTransferConfig | None      # the KV connector (--kv-transfer-config, --kv-offloading-*); None: none
