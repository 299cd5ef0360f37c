"""User-facing EngineArgs and the frozen configs the engine is built from."""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import Any

from pagedserve.common.config.arg_utils import check_choices, setting
from pagedserve.common.config.rules import (check_lora_engine, check_parallel, check_pipeline, check_positive,
                                            check_timeout, resolve_device, resolve_max_model_len, weight_only)
from pagedserve.common.kv_transfer.config import KV_OFFLOADING_BACKENDS
from pagedserve.common.kv_transfer.identity import resolve_kv_transfer
from pagedserve.common.config.dtype import DTYPE_CHOICES, checkpoint_dtype, resolve_dtype, resolve_kv_cache_dtype
from pagedserve.common.model.generation_config import AUTO, check_setting, load_generation_defaults
from pagedserve.common.model.hub import TOKENIZER_FILES, local_or_hub_path, looks_like_hub_id
from pagedserve.common.model.model_files import ModelSource, load_hf_config, resolve_model
from pagedserve.common.multimodal.config import DEFAULT_MM_PROCESSOR_CACHE_GB, resolve_multimodal
from pagedserve.common.pooler_config import CONVERTS, RUNNERS, PoolerConfig, position_limit, resolve_pooler
from pagedserve.common.quantization import (QUANTIZATION_CHOICES, checkpoint_quant_spec, resolve_quantization)
from pagedserve.common.reasoning import REASONING_PARSERS
from pagedserve.common.config.engine_config import (CacheConfig, EngineConfig, LoRAConfig,  # noqa: F401
                                             ModelConfig, ParallelConfig, RLConfig, SchedulerConfig,
                                             StructuredOutputsConfig)
from pagedserve.common.speculative import SpeculativeConfig, mark_eagle_head, parse_speculative_config

logger = logging.getLogger(__name__)

# The allowed values of EngineArgs fields: the flags' choices and `_validate` both use these.
DTYPES = DTYPE_CHOICES
DEVICES = ("auto", "cpu", "cuda")
# auto: the KV cache in the model dtype (bfloat16 for int4/int8 weights on CPU: dtype.resolve_kv_cache_dtype);
# fp8 (vLLM also spells it fp8_e4m3): e4m3 with per-layer scales.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3")
SCHEDULING_POLICIES = ("fcfs", "priority")
# sleep mode: what becomes of a request that arrives while the engine sleeps (core/rl/control.py)
REQUESTS_WHILE_SLEEPING = ("reject", "wait")
# "uni" (in-process) | "mp" (one process per rank) | "torchrun" (ranks started by torchrun)
EXECUTOR_BACKENDS = ("uni", "mp", "ray", "torchrun")
# What an unset kv_cache_memory (CPU) and max_num_batched_tokens (with chunked prefill) become: the unset
# values are resolved once, in create_engine_config.
DEFAULT_CPU_KV_CACHE_GIB = 2.0
DEFAULT_MAX_NUM_BATCHED_TOKENS = 2048
# What an unset worker_heartbeat_timeout becomes: worker processes beat at least every second; torchrun ranks
# wait for each other in collectives, and at start-up one rank may load its model long after another.
DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S = 30.0
DEFAULT_TORCHRUN_COLLECTIVE_TIMEOUT_S = 300.0
# The engine core sends every live client something at least this often, an empty message if idle.
CORE_HEARTBEAT_INTERVAL_S = 1.0
# A client that is listening sends the core something (a ping if nothing else) at least this often; the core
# stops sending stats and beats to a client it has not heard from for CLIENT_EXPIRY_S (it left).
CLIENT_KEEPALIVE_S = 10.0
CLIENT_EXPIRY_S = 60.0


@dataclass
class EngineArgs:
    """The knobs a user sets (mirrors `vllm serve` flags); `create_engine_config` validates them.

    Each field is also an `engine-serve` flag, generated from it (common/config/arg_utils.py): its help is the
    flag's help."""
    model: str | None = setting(
        None, help="HF model folder, .gguf file or Hugging Face Hub id (org/name; a local path of the same "
                   "spelling wins) (unset: the embedded SmolLM2-135M-Instruct)")
    tokenizer: str | None = setting(
        None, help="a tokenizer folder or Hub id to use instead of the model's own")
    revision: str | None = setting(
        None, help="the Hub revision (branch, tag or commit) of a model given as a Hub id (unset: main)")
    tokenizer_revision: str | None = setting(
        None, help="the Hub revision of the tokenizer (unset: the model's revision)")
    download_dir: str | None = setting(
        None, help="the Hugging Face cache folder to find and download Hub models in (unset: HF_HUB_CACHE, "
                   "else HF_HOME/hub)")
    generation_config: str = setting(
        AUTO, help="where request defaults (temperature, top_p, top_k, min_p, repetition_penalty) and extra "
                   "EOS ids come from: auto (the model's generation_config.json), vllm (none: the engine's "
                   "defaults) or a folder holding a generation_config.json")
    served_model_name: str | None = setting(
        None, help="the model name the API answers to and reports (unset: the model's folder or file name)")
    dtype: str = setting("auto", choices=DTYPES,
                         help="weights and activations (half = float16, float = float32); auto: on CUDA the "
                              "checkpoint's dtype, as vLLM (float32 checkpoints run in bfloat16), on CPU "
                              "bfloat16 where the CPU has native bf16, else float32, and float32 for int4/int8 "
                              "weights (their kernels round activations to bfloat16 themselves)")
    device: str = setting("auto", choices=DEVICES, help="where the model runs; auto: CUDA if available")
    quantization: str | None = setting(
        None, aliases=("-q",), choices=QUANTIZATION_CHOICES,
        help="weight quantization (unset: the checkpoint's own: a GGUF file's blocks stay quantized, an "
             "AWQ/GPTQ/fp8 checkpoint's quantization_config is followed); int8: weight-only per output "
             "channel, at load, CPU and GPU; fp8: e4m3 weights at load, GPU; none: a GGUF file is "
             "dequantized at load")
    # Accepted so that vLLM launch scripts and LLM(...) calls run unchanged; they change nothing here.
    trust_remote_code: bool = setting(
        False, store_true=True, help="accepted for vLLM compatibility, no effect: models load through "
                                     "pagedserve's own model classes and no code from a checkpoint is ever run")
    disable_log_stats: bool = setting(
        False, store_true=True, help="accepted for vLLM compatibility, no effect: the engine logs no periodic "
                                     "stats (GET /metrics has them)")
    seed: int = setting(0, help="random seed for sampling requests that bring no seed of their own")
    max_model_len: int | None = setting(
        None, help="longest sequence (prompt + output) in tokens (unset: the model's max_position_embeddings)")
    block_size: int = setting(16, help="tokens per KV-cache block")
    kv_cache_dtype: str = setting(
        "auto", choices=KV_CACHE_DTYPES,
        help="KV-cache element type: auto (the model dtype; on CPU bfloat16 for int4/int8 weights, whose "
             "activations are float32: decode attention reads the whole cache every step), bfloat16, float32, "
             "or fp8 / fp8_e4m3 (e4m3, 1 byte per element: twice "
             "the blocks of a 16-bit cache in the same memory; per-layer k_scale/v_scale from the checkpoint, "
             "else 1.0; on CUDA needs compute capability 8.9+)")
    kv_cache_memory: float | None = setting(
        None, help=f"KV-cache size in GiB on CPU (unset: {DEFAULT_CPU_KV_CACHE_GIB:g} GiB)")
    gpu_memory_utilization: float = setting(
        0.9, help="share of GPU memory (0-1] for weights, activations and the KV cache, which gets the rest")
    enable_prefix_caching: bool = setting(
        True, help="reuse the KV blocks of prompt prefixes that earlier requests computed")
    num_gpu_blocks_override: int | None = setting(
        None, help="exactly this many KV-cache blocks, instead of sizing the cache from memory (for tests)")
    max_num_seqs: int = setting(128, help="most requests running in one step")
    max_num_batched_tokens: int | None = setting(
        None, help=f"most tokens in one step (unset: {DEFAULT_MAX_NUM_BATCHED_TOKENS} with chunked prefill, "
                   "else max_model_len)")
    max_waiting_requests: int | None = setting(
        4096, help="new requests beyond this many waiting in the engine core (all clients together) are "
                   "refused: HTTP 429 from the server")
    scheduling_policy: str = setting(
        "fcfs", choices=SCHEDULING_POLICIES,
        help="which waiting request runs first: fcfs (arrival order) or priority (the request's priority "
             "field, lower first)")
    enable_chunked_prefill: bool = setting(
        True, help="split long prompts over several steps, so decodes keep running beside them")
    tensor_parallel_size: int = setting(1, aliases=("-tp",), help="ranks each layer is split over")
    pipeline_parallel_size: int = setting(
        1, aliases=("-pp",), help="stages the layers are split over (by count: the embedding on the first, the "
                                  "final norm and LM head on the last); tensor_parallel_size x this ranks in all")
    data_parallel_size: int = setting(
        1, aliases=("-dp",), help="engine cores engine-serve starts, each with its own scheduler, KV cache and "
                                  "ranks, behind one API server (requests routed by cached prefix and load)")
    distributed_executor_backend: str | None = setting(
        None, choices=EXECUTOR_BACKENDS,
        help="uni: in-process, mp: a process per rank, ray: a Ray actor per rank (RAY_ADDRESS's cluster, else a "
             "local one; pip install 'pagedserve[ray]'), torchrun: ranks started by torchrun (unset: uni for one "
             "rank, else mp)")
    enforce_eager: bool = setting(False, store_true=True, help="CUDA: no CUDA graphs for decode steps")
    batch_invariant: bool = setting(      # vLLM has the env var only; the flag is ours, one setting with it
        env="VLLM_BATCH_INVARIANT", help="a row's bits independent of the rows beside it on the CPU paths that "
        "cost for it: float linears in fixed blocks of 16 rows, each token's attention alone through the C "
        "kernel (docs/determinism.md); the quantized C step is invariant either way")
    async_scheduling: bool = setting(
        False, help="schedule the next step while the current one runs (vLLM's --async-scheduling): the "
                    "host's scheduling overlaps the model; a stop found late costs one dropped token")
    reasoning_parser: str | None = setting(
        None, choices=tuple(REASONING_PARSERS),
        help="the model thinks between markers: the server returns that as reasoning_content, and a "
             "structured output constrains only the answer after it")
    structured_outputs_compile_timeout: float = setting(
        10.0, help="seconds a request's grammar (response_format, structured_outputs, guided_*) may take to "
                   "compile before the request fails with a 400; compiles run beside the engine loop")
    enable_lora: bool = setting(False, store_true=True, help="serve LoRA adapters over the base model "
                                                             "(docs/lora.md)")
    max_loras: int = setting(1, help="with --enable-lora: adapters in one batch")
    max_lora_rank: int = setting(16, help="with --enable-lora: the largest adapter rank accepted")
    max_cpu_loras: int | None = setting(None, help="with --enable-lora: adapters kept loaded, least recently used "
                                                   "unloaded beyond it (unset: --max-loras)")
    speculative_config: dict[str, Any] | None = setting(
        None, help="speculative decoding, vLLM's keys as a JSON object: {\"method\": \"ngram\", "
                   "\"num_speculative_tokens\": 5, \"prompt_lookup_max\": 4, \"prompt_lookup_min\": 2} "
                   "(docs/speculative_decoding.md; unset: off)")
    worker_heartbeat_timeout: float | None = setting(
        None, help=f"seconds a worker process may go without a heartbeat before the engine fails (TP > 1); its "
                   f"own thread beats, so a long step does not count; under torchrun, how long a rank may keep the "
                   f"others waiting in a collective (unset: {DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S:g} s, under "
                   f"torchrun {DEFAULT_TORCHRUN_COLLECTIVE_TIMEOUT_S:g} s, to allow for start-up skew)")
    runner: str = setting(
        "auto", choices=RUNNERS,
        help="generate: a language model; pooling: embeddings, classification and scores (docs/pooling.md); "
             "auto: pooling for encoder checkpoints (BertModel, XLMRobertaModel, *ForSequenceClassification) "
             "and with --convert embed|classify, else generate")
    convert: str = setting(
        "auto", choices=CONVERTS,
        help="with --runner pooling: run a causal LM checkpoint as an embedding model (embed: last-token "
             "pooling, normalized, as Qwen3-Embedding / gte-Qwen2); auto: the checkpoint's own task")
    engine_heartbeat_timeout: float = setting(
        30.0, help=f"seconds a client may hear nothing from the engine core (it beats every "
                   f"{CORE_HEARTBEAT_INTERVAL_S:g} s) before it declares the core dead: the server then ends "
                   "open streams with an error and turns /health 503")

    limit_mm_per_prompt: dict[str, Any] | None = setting(
        None, help="multimodal models: the most items of each modality one prompt may hold, as a JSON object "
                   "({\"image\": 2, \"video\": 0}; unset: 999 each, as vLLM); a text model takes none")
    mm_processor_kwargs: dict[str, Any] | None = setting(
        None, help="multimodal models: overrides for the HF processor, as a JSON object (e.g. "
                   "{\"max_pixels\": 200704} for Qwen2-VL)")
    media_io_kwargs: dict[str, Any] | None = setting(
        None, help="multimodal models: how media is loaded, per modality, as a JSON object (vLLM's); "
                   "{\"video\": {\"num_frames\": N}}: a video keeps N frames sampled uniformly (default 32)")
    mm_processor_cache_gb: float = setting(
        DEFAULT_MM_PROCESSOR_CACHE_GB, help="GiB of processed images the frontend keeps, by content hash, so a "
                                            "repeated image is neither processed nor sent to the engine again")
    allowed_local_media_path: str | None = setting(
        None, help="a folder file:// image URLs may be read from (unset: file:// URLs are refused)")
    kv_transfer_config: dict[str, Any] | None = setting(
        None, help="the KV connector, vLLM's keys as a JSON object: {\"kv_connector\": \"OffloadingConnector\", "
                   "\"kv_role\": \"kv_both\", \"kv_connector_extra_config\": {\"backend\": \"disk\", \"path\": "
                   "\"/var/kv\", \"size_gib\": 8}} (docs/kv_tiers.md; unset: none)")
    kv_offloading_backend: str | None = setting(
        None, choices=KV_OFFLOADING_BACKENDS, help="a KV tier below the pool, as vLLM's flag: disk (blocks in "
        "--kv-offloading-path, kept across restarts); native (a host-memory tier: refused, on CPU the pool is "
        "host memory already; docs/kv_tiers.md); shorthand for an OffloadingConnector --kv-transfer-config")
    kv_offloading_size: float | None = setting(None, help="with --kv-offloading-backend: the tier's GiB (LRU beyond)")
    kv_offloading_path: str | None = setting(None, help="with --kv-offloading-backend disk: a writable folder")
    worker_extension_cls: str | None = setting(
        None, help="a class (\"module.Class\") whose methods are added to every worker, callable with "
                   "collective_rpc (RL weight syncing: docs/rl_weight_updates.md)")
    enable_sleep_mode: bool = setting(False, store_true=True,
                                      help="allow sleep()/wake_up(): free the KV cache (level 1) and the weights "
                                           "(level 2) between rollouts (docs/rl_weight_updates.md)")
    requests_while_sleeping: str = setting(
        "reject", choices=REQUESTS_WHILE_SLEEPING,
        help="a request that arrives while the engine sleeps: reject (HTTP 503, retry after wake_up) or wait "
             "(queued until wake_up)")

    def create_engine_config(self) -> EngineConfig:
        """Resolve every setting (model files, the Hub, the device) once; the result crosses to other
        processes as data (common/config/wire.py), so none of them repeats this."""
        self.validate()
        model = self._model_config()
        pooler = resolve_pooler(self.runner, self.convert, model.hf_config,
                                model.source.path if model.source.format == "hf" else None)
        cache = CacheConfig(
            block_size=self.block_size,
            kv_cache_memory_gib=DEFAULT_CPU_KV_CACHE_GIB if self.kv_cache_memory is None else self.kv_cache_memory,
            gpu_memory_utilization=self.gpu_memory_utilization,
            # A pooler that reads the whole prompt needs every position computed in its step (an encoder keeps
            # no KV cache at all): nothing may come from the prefix cache.
            enable_prefix_caching=self.enable_prefix_caching and not (pooler is not None and pooler.whole_prompt),
            num_blocks_override=self.num_gpu_blocks_override,
            cache_dtype=resolve_kv_cache_dtype(self.kv_cache_dtype, model.device, model.dtype,
                                               weight_only(model.quantization)))
        parallel = ParallelConfig(tensor_parallel_size=self.tensor_parallel_size,
                                  distributed_executor_backend=self.executor_backend(),
                                  worker_heartbeat_timeout_s=self.resolved_worker_heartbeat_timeout(),
                                  pipeline_parallel_size=self.pipeline_parallel_size)
        check_parallel(parallel.tensor_parallel_size, model.num_heads, model.num_kv_heads,
                       getattr(model.hf_config, "intermediate_size", None))
        check_pipeline(self.pipeline_parallel_size, model.hf_config, parallel.distributed_executor_backend,
                       self.speculative_config, self.async_scheduling)
        structured = StructuredOutputsConfig(reasoning_parser=self.reasoning_parser,
                                             compile_timeout_s=float(self.structured_outputs_compile_timeout))
        speculative = parse_speculative_config(self.speculative_config, self.tensor_parallel_size)
        scheduler = self._scheduler_config(model.max_model_len)
        draft = self._draft_model_config(speculative, model)
        multimodal = resolve_multimodal(model.arch_config, self.limit_mm_per_prompt, self.mm_processor_kwargs,
                                        self.mm_processor_cache_gb, self.allowed_local_media_path,
                                        scheduler.max_num_batched_tokens,
                                        model.source.path if model.source.format == "hf" else None,
                                        self.media_io_kwargs, model.max_model_len)
        return EngineConfig(model=model, cache=cache, scheduler=scheduler,
                            parallel=parallel, multimodal=multimodal, structured_outputs=structured,
                            speculative=speculative,
                            draft_model=draft, lora=self._lora_config(model),
                            pooler=self._check_pooler(pooler),
                            rl=RLConfig(worker_extension_cls=self.worker_extension_cls,
                                        enable_sleep_mode=self.enable_sleep_mode,
                                        requests_while_sleeping=self.requests_while_sleeping),
                            kv_transfer=resolve_kv_transfer(self, model, draft, speculative, cache, parallel,
                                                            pooler is not None))

    def _check_pooler(self, pooler: PoolerConfig | None) -> PoolerConfig | None:
        if pooler is None:
            return None
        if self.speculative_config is not None or self.enable_lora or self.pipeline_parallel_size > 1:
            raise ValueError("runner: a pooling model runs without speculative_config, enable_lora and "
                             "pipeline_parallel_size > 1")
        if not pooler.causal and self.tensor_parallel_size > 1:
            raise ValueError("tensor_parallel_size: encoder models (BERT family) run on one rank")
        return pooler

    def _lora_config(self, model: ModelConfig) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        check_lora_engine(model.hf_config, self.pipeline_parallel_size, self.speculative_config)
        cpu = self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras
        if cpu < self.max_loras:
            raise ValueError(f"max_cpu_loras ({cpu}) must be >= max_loras ({self.max_loras})")
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank, max_cpu_loras=cpu)

    def _model_config(self) -> ModelConfig:
        source = resolve_model(self.model, self.revision, self.download_dir)
        full_config = load_hf_config(source)
        hf_config = full_config.get_text_config() if hasattr(full_config, "get_text_config") else full_config
        gen = load_generation_defaults(self.generation_config, source.path if source.format == "hf" else None)
        device = resolve_device(self.device, self.executor_backend())
        quantization = resolve_quantization(self.quantization, checkpoint_quant_spec(hf_config),
                                            source.format == "gguf")
        dtype = resolve_dtype(self.dtype, device, checkpoint_dtype(hf_config),
                              weight_only_quantized=weight_only(quantization))
        return ModelConfig(
            source=source, hf_config=hf_config, dtype=dtype, device=device,
            max_model_len=self._max_model_len(hf_config), seed=self.seed,
            served_model_name=self.served_model_name or source.name, enforce_eager=self.enforce_eager,
            batch_invariant=self.batch_invariant,
            tokenizer=self._resolve_tokenizer(source), default_sampling=gen.sampling,
            generation_eos_token_ids=gen.eos_token_ids, quantization=quantization,
            mm_config=full_config if hf_config is not full_config else None)

    def _max_model_len(self, hf_config: Any) -> int:
        limit = position_limit(hf_config)
        if limit is not None and (self.max_model_len or limit) > limit:
            raise ValueError(f"max_model_len ({self.max_model_len}) exceeds the model's maximum length ({limit})")
        return resolve_max_model_len(self.max_model_len or limit, hf_config)

    def _draft_model_config(self, spec: SpeculativeConfig | None, target: ModelConfig) -> ModelConfig | None:
        """The draft model (or EAGLE head) of speculative_config.model, in the model's dtype and length;
        ValueError naming the field."""
        if spec is None or spec.model is None:
            return None
        args = dataclasses.replace(self, model=spec.model, tokenizer=None, tokenizer_revision=None, revision=None,
                                   quantization=None, served_model_name=None, speculative_config=None,
                                   dtype=target.dtype, max_model_len=target.max_model_len)
        draft = args._model_config()
        if draft.vocab_size != target.vocab_size:
            raise ValueError(f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} tokens) differs "
                             f"from the model's ({target.vocab_size}); a draft must share the tokenizer")
        if spec.is_eagle:
            mark_eagle_head(draft.hf_config, spec.method, target.hf_config)
        if spec.draft_tensor_parallel_size > 1:
            try:
                check_parallel(spec.draft_tensor_parallel_size, draft.num_heads, draft.num_kv_heads,
                               getattr(draft.hf_config, "intermediate_size", None))
            except ValueError as exc:
                raise ValueError(f"speculative_config.draft_tensor_parallel_size: the draft cannot shard: {exc} "
                                 "(1 runs it whole on each rank)") from None
        return draft

    def _scheduler_config(self, max_len: int) -> SchedulerConfig:
        unset_batched = DEFAULT_MAX_NUM_BATCHED_TOKENS if self.enable_chunked_prefill else max_len
        batched = self.max_num_batched_tokens or unset_batched
        if not self.enable_chunked_prefill and batched < max_len:
            raise ValueError(f"max_num_batched_tokens ({batched}) must be >= max_model_len ({max_len}) "
                             "when chunked prefill is disabled")
        return SchedulerConfig(
            max_num_batched_tokens=batched, max_num_seqs=self.max_num_seqs, max_model_len=max_len,
            policy=self.scheduling_policy, enable_chunked_prefill=self.enable_chunked_prefill,
            max_waiting_requests=self.max_waiting_requests, async_scheduling=self.async_scheduling,
            batch_queue_size=self.pipeline_parallel_size, max_loras=self.max_loras if self.enable_lora else 0)

    def _resolve_tokenizer(self, source: ModelSource) -> str | None:
        """A local folder for --tokenizer or --tokenizer-revision; None: the model's own files."""
        if self.tokenizer is not None:
            return local_or_hub_path(self.tokenizer, self.tokenizer_revision, self.download_dir,
                                     TOKENIZER_FILES, what="tokenizer")[0]
        if self.tokenizer_revision is not None and source.hub_id is not None:
            return local_or_hub_path(source.hub_id, self.tokenizer_revision, self.download_dir,
                                     TOKENIZER_FILES, what="tokenizer")[0]
        return None

    def executor_backend(self) -> str:
        """The executor backend to build: the one asked for, else in-process for one rank."""
        one_rank = self.tensor_parallel_size == 1 and self.pipeline_parallel_size == 1
        return self.distributed_executor_backend or ("uni" if one_rank else "mp")

    def resolved_worker_heartbeat_timeout(self) -> float:
        """worker_heartbeat_timeout, or its default for the executor backend (a torchrun launcher needs it
        for its process group before any config exists)."""
        if self.worker_heartbeat_timeout is not None:
            return float(self.worker_heartbeat_timeout)
        if self.executor_backend() == "torchrun":
            return DEFAULT_TORCHRUN_COLLECTIVE_TIMEOUT_S
        return DEFAULT_WORKER_HEARTBEAT_TIMEOUT_S

    def validate(self) -> None:
        """The checks that need no model files: cheap, so a launcher can fail fast before starting anything."""
        if self.tokenizer is not None and not os.path.isdir(self.tokenizer) and not looks_like_hub_id(self.tokenizer):
            raise ValueError(f"tokenizer must be a local tokenizer folder or a Hugging Face Hub id, "
                             f"got {self.tokenizer!r}")
        check_setting(self.generation_config)
        for name in ("block_size", "max_num_seqs", "tensor_parallel_size", "pipeline_parallel_size",
                     "data_parallel_size", "max_loras", "max_lora_rank"):
            check_positive(name, getattr(self, name))
        for name in ("max_cpu_loras", "max_num_batched_tokens", "max_model_len", "num_gpu_blocks_override",
                     "max_waiting_requests"):       # unset: resolved later
            if (value := getattr(self, name)) is not None:
                check_positive(name, value)
        if self.kv_cache_memory is not None and not self.kv_cache_memory > 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.worker_heartbeat_timeout is not None:
            check_timeout("worker_heartbeat_timeout", self.worker_heartbeat_timeout, 0)
        check_timeout("structured_outputs_compile_timeout", self.structured_outputs_compile_timeout, 0)
        check_timeout("engine_heartbeat_timeout", self.engine_heartbeat_timeout, 2 * CORE_HEARTBEAT_INTERVAL_S)
        check_choices(self)
        parse_speculative_config(self.speculative_config, self.tensor_parallel_size)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)}
