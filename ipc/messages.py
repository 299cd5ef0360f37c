"""Everything that crosses a process boundary, as msgspec Structs (no pickle anywhere)."""
from __future__ import annotations

from typing import Any, Optional, Union

import msgspec

from pagedserve.common.errors import error_field, error_kind
from pagedserve.common.params.pooling_params import PoolingParams
from pagedserve.common.params.sampling_params import SamplingParams

# ---------------------------------------------------------------- multimodal items


class TensorData(msgspec.Struct, array_like=True):
    """A tensor as raw little-endian bytes: ipc/ stays free of torch and numpy, and no pickle crosses."""
    dtype: str              # a torch dtype's name: "float32", "bfloat16", "int64", ...
    shape: list[int]
    data: bytes


class MultiModalFeature(msgspec.Struct, array_like=True, omit_defaults=True):
    """One image (or video), or one sub-image, of a prompt: where its placeholder tokens sit and what the
    encoder reads.
    mm_hash identifies the item's content and processing: the encoder cache and the prefix cache key on it."""
    modality: str            # "image" | "video"
    mm_hash: str
    offset: int              # its first placeholder token in the prompt
    length: int              # its placeholder tokens, all embedded from the encoder's output
    # The processor's outputs for this item (pixel_values, image_grid_thw, ...); None where the receiver
    # already holds them (the workers are sent them only with the step that encodes the item).
    data: Optional[dict[str, TensorData]] = None
    # Which piece of its image the item is: Idefics3 sends each sub-image as an item, parts 0, 1, ... in a
    # row; a whole image is part 0. The per-prompt limits count images, i.e. parts 0.
    part: int = 0


class EncoderInput(msgspec.Struct, array_like=True):
    """An item the workers encode this step, into their encoder cache under mm_hash."""
    mm_hash: str
    modality: str
    data: dict[str, TensorData]

# ---------------------------------------------------------------- frontend -> engine core


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, tag="add"):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    arrival_time: float
    priority: int = 0
    client_index: int = 0
    lora_int_id: int = 0      # a LoRA adapter the core registered (add_lora); 0: the base model
    # A pooling request (embed, classify, score): its prompt is computed, pooled and answered, never decoded;
    # its sampling_params are then only max_tokens=0 and the output kind.
    pooling_params: Optional[PoolingParams] = None
    mm_features: Optional[list[MultiModalFeature]] = None    # images of the prompt, in prompt order
    # --collect-detailed-traces: sum the model's step times over the steps this request is in (core/tracing/).
    trace_model_times: bool = False


class AbortRequests(msgspec.Struct, array_like=True, tag="abort"):
    request_ids: list[str]


class UtilityCall(msgspec.Struct, array_like=True, tag="utility"):
    call_id: int
    method: str
    # JSON-able values (collective_rpc passes lists and dicts through); tensors never cross here.
    args: list[Any] = []


EngineCoreInput = Union[EngineCoreRequest, AbortRequests, UtilityCall]

# ---------------------------------------------------------------- engine core -> frontend


class LogprobsEntry(msgspec.Struct, array_like=True):
    """Logprobs for one sampled position: ids[0]/logprobs[0] are the sampled token, then the top-k."""
    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


class EngineCoreEvent(msgspec.Struct, array_like=True):
    """A moment of a request's life in the engine core (vLLM's EngineCoreEventType names), as seconds since its
    arrival on the frontend's clock: a duration, so a core on another host with another clock still places it."""
    kind: str                               # "QUEUED" | "SCHEDULED" | "PREEMPTED"
    seconds: float


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    request_id: str
    new_token_ids: list[int]
    finish_reason: Optional[str] = None     # "stop" | "length" | "abort" | "error"
    stop_reason: Optional[int] = None       # the stop token id, when one (not EOS) ended it
    new_logprobs: Optional[list[LogprobsEntry]] = None
    num_cached_tokens: int = 0
    error: Optional[str] = None
    error_kind: Optional[str] = None        # with error: common.errors.INVALID | OVERLOADED
    queue_time: Optional[float] = None      # on a request's first token: seconds from arrival to first scheduled
    # Prompt positions scored this step, in order (entry j: the logprob of prompt token p+1 given 0..p).
    new_prompt_logprobs: Optional[list[LogprobsEntry]] = None
    error_field: Optional[str] = None       # with error: the request field at fault (RequestError.field)
    pooling_output: Optional[bytes] = None  # a pooling request's answer: float32 values, little-endian, raw
    events: Optional[list[EngineCoreEvent]] = None      # those since its last output (traces)
    # On the finished output of a request with trace_model_times: seconds, summed over the steps it was in, of
    # the answering rank's model forward and of the executor's whole step (forward, ranks' sync, sampling).
    model_forward_time: Optional[float] = None
    model_execute_time: Optional[float] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


def refused_output(request_id: str, exc: ValueError) -> EngineCoreOutput:
    """The output that ends a request the core refused or failed: its message, kind and field, as data."""
    return EngineCoreOutput(request_id=request_id, new_token_ids=[], finish_reason="error", error=str(exc),
                            error_kind=error_kind(exc), error_field=error_field(exc))


class KVTransferStats(msgspec.Struct, array_like=True, omit_defaults=True):
    """A KV connector's tier, totals since start (the kv_transfer section of /metrics: vllm:kv_offload_*)."""
    device: str = "CPU"            # the pool's side of vLLM's transfer_type labels: CPU, GPU
    block_lookups: int = 0         # blocks looked up in the tier after the prefix cache (a chain up to its miss)
    block_hits: int = 0
    block_misses: int = 0
    invalid_blocks: int = 0        # hits whose file turned out missing, damaged or foreign at load: computed
    load_bytes: int = 0            # read from the tier into the pool, and the seconds it took
    load_time_s: float = 0.0
    store_bytes: int = 0           # written from the pool to the tier, and the seconds it took
    store_time_s: float = 0.0
    stores_skipped: int = 0        # blocks not stored: the writer behind, or saving stopped by an I/O error
    evictions: int = 0             # blocks the tier deleted to stay within its size
    swapped_in_tokens: int = 0     # tokens of preempted requests loaded back on resume, not recomputed


class SchedulerStats(msgspec.Struct, array_like=True):
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_step_tokens: int = 0    # tokens the step that sent these stats ran (0: stats sent without a step)
    # Speculative decoding, totals since start (vLLM's vllm:spec_decode_* counters): verify passes of a
    # request with drafts, draft tokens verified, accepted, and accepted at each draft position.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = []
    # LoRA (vllm:lora_requests_info): the names of adapters with running and with waiting requests.
    running_lora_adapters: list[str] = []
    waiting_lora_adapters: list[str] = []
    # A KV connector's tier (vLLM's vllm:external_prefix_cache_*): tokens looked up there after the prefix
    # cache, and of those, tokens it held.
    external_prefix_cache_queries: int = 0
    external_prefix_cache_hits: int = 0
    # Requests whose connector load is in flight (in num_waiting too), and whose load finished with the step
    # that sent these stats (they run from the next): a step that only loaded is no stall.
    num_loading: int = 0
    num_loads_done: int = 0
    kv_connector_stats: Optional[KVTransferStats] = None    # vLLM's SchedulerStats field; None: no connector


class EngineCoreOutputs(msgspec.Struct, array_like=True, omit_defaults=True):
    outputs: list[EngineCoreOutput] = []
    scheduler_stats: Optional[SchedulerStats] = None
    utility_results: list["UtilityResult"] = []
    engine_dead: Optional[str] = None       # set once, as the core's last words: why it died
    # Which data-parallel engine core sent these (set by the frontend's DataParallelClient on arrival).
    engine_index: int = 0


class EngineInfo(msgspec.Struct, kw_only=True):
    """Everything a frontend needs from the engine core it talks to. The core tells (in its handshake, and to
    any client through the `get_engine_info` utility); no frontend rebuilds the engine's configuration."""
    served_model_name: str
    model_path: str                  # where the weights were loaded from (HF folder or .gguf file)
    tokenizer: str                   # a folder AutoTokenizer loads (a GGUF vocabulary is converted there once)
    max_model_len: int
    vocab_size: int
    eos_token_ids: list[int]
    max_waiting_requests: Optional[int]   # the core's queue bound; None = unbounded
    block_size: int
    num_blocks: int
    # generation_config.json's defaults for sampling fields a request leaves unset (only the keys it sets).
    default_sampling: dict[str, Union[int, float]] = {}
    reasoning_parser: Optional[str] = None    # --reasoning-parser: the frontend splits reasoning_content by it
    max_loras: int = 0                         # --enable-lora: adapters in one batch (0: LoRA off)
    # --runner pooling: the tasks the model answers ([]: a generating model), Matryoshka dimensions, and the
    # most tokens one prompt may have when the pooler needs it in one step (None: chunked).
    pooling_tasks: list[str] = []
    is_matryoshka: bool = False
    matryoshka_dimensions: Optional[list[int]] = None
    max_whole_prompt: Optional[int] = None
    # A multimodal model: the most items of each modality one prompt may hold ({}: text only), the HF
    # processor's overrides (--mm-processor-kwargs) and where file:// media may come from.
    mm_limits: dict[str, int] = {}
    mm_processor_kwargs: dict[str, Any] = {}
    allowed_local_media_path: Optional[str] = None
    mm_max_tokens_per_item: int = 0
    mm_processor_cache_gb: float = 0.0
    mm_family: str = ""                        # common/multimodal/families.py: how the frontend expands items
    mm_media_io_kwargs: dict[str, Any] = {}    # --media-io-kwargs: how media is loaded (a video's frames)


class EngineReady(msgspec.Struct, array_like=True, tag="ready"):
    """Startup handshake from the engine core process."""
    info: EngineInfo


class EngineStartupFailed(msgspec.Struct, array_like=True, tag="failed"):
    error: str


EngineHandshake = Union[EngineReady, EngineStartupFailed]


class EngineRegistration(msgspec.Struct, array_like=True):
    """A headless node's engine core announcing itself to the head (multi-node data parallelism): where its
    sockets are, signed with the shared engine token (HMAC-SHA256 of rank, input and output)."""
    rank: int
    input: str
    output: str
    mac: str


class UtilityResult(msgspec.Struct, array_like=True, omit_defaults=True):
    call_id: int
    result: Union[int, float, str, bool, None, list, dict] = None
    error: Optional[str] = None

# ---------------------------------------------------------------- engine core -> workers


class NewRequestData(msgspec.Struct, array_like=True):
    """A request the workers have not seen (or one resuming after preemption, with its outputs)."""
    req_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    sampling_params: SamplingParams
    block_ids: list[int]
    num_computed_tokens: int
    lora_int_id: int = 0
    pooling_params: Optional[PoolingParams] = None
    mm_features: Optional[list[MultiModalFeature]] = None     # positions and hashes only (data is None)


class CachedRequestData(msgspec.Struct, array_like=True):
    """Requests the workers already hold, column by column: only what changed."""
    req_ids: list[str] = []
    new_block_ids: list[list[int]] = []
    num_computed_tokens: list[int] = []
    # Pipeline parallelism: the ids of the tokens each request runs this step. Only the last stage samples,
    # so the others learn each request's new tokens here (vLLM's new_token_ids); empty without stages.
    new_token_ids: list[list[int]] = []


class GrammarBitmask(msgspec.Struct, array_like=True):
    """The allowed tokens of the rows that sample under a grammar this step: an int32 [rows, num_words]
    array as bytes (bit t of a row: token t is allowed), row i for req_ids[i]."""
    req_ids: list[str]
    data: bytes
    num_words: int


class KVBlockTransfer(msgspec.Struct, array_like=True):
    """One block between the KV cache and a connector's store: the cache's block id and the store's key."""
    block_id: int
    key: bytes               # the block's chained hash (core/block_hash.py)
    depth: int               # its index in its prefix chain
    parent: bytes = b""      # the chain's block before it (b"": the first); in the file, so a restart knows it


class KVConnectorMetadata(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the scheduler's connector asks of the workers' this step (vLLM's KVConnectorMetadata)."""
    # By request, in chain order: blocks to fill before this step runs (the request runs in a later step).
    loads: dict[str, list[KVBlockTransfer]] = {}
    # Blocks whose every token's KV this step completes: stored once the step has written them.
    saves: list[KVBlockTransfer] = []


class KVConnectorOutput(msgspec.Struct, array_like=True, omit_defaults=True):
    """What the workers' connector reports back (vLLM's KVConnectorOutput)."""
    # Requests whose loads are done, each with how many of its blocks arrived intact: a prefix of its list;
    # the blocks after the first bad one are computed instead.
    finished_recving: dict[str, int] = {}
    saved: list[tuple[bytes, int]] = []        # (key, bytes on disk) of blocks stored since the last report
    failed_saves: list[bytes] = []             # blocks not stored (the writer is behind, or an I/O error)
    invalid_keys: list[bytes] = []             # stored blocks found missing, corrupt or foreign (deleted)
    saves_disabled: bool = False               # an I/O error stopped saving (the worker warned once)
    load_bytes: int = 0                        # read from the tier since the last report, in load_time_s
    load_time_s: float = 0.0
    store_time_s: float = 0.0                  # seconds the saved blocks took to write


class SchedulerOutput(msgspec.Struct, array_like=True):
    """One step's work, as a diff against the persistent batch the workers keep."""
    scheduled_new_reqs: list[NewRequestData]
    scheduled_cached_reqs: CachedRequestData
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    finished_req_ids: list[str]          # finished, aborted or preempted: drop from the batch
    grammar_bitmask: Optional[GrammarBitmask] = None   # None when no scheduled row is constrained
    # Draft tokens to verify, by request: such a request's num_scheduled_tokens counts them after its one
    # real token, and the workers read their ids from here (they are no token of the request yet).
    scheduled_spec_decode_tokens: dict[str, list[int]] = {}
    # Draft model / EAGLE head (the workers propose): how many tokens to propose after this step, by request,
    # for the next step's verify pass (the core's plan; an absent request gets no proposal pass).
    num_draft_tokens_to_propose: dict[str, int] = {}
    # Multimodal: items to encode before this step's forward, and encoder outputs the workers may drop (the
    # core's encoder cache evicted them); frees come first.
    encoder_inputs: list[EncoderInput] = []
    free_encoder_mm_hashes: list[str] = []
    kv_connector_metadata: Optional[KVConnectorMetadata] = None     # --kv-transfer-config: loads and saves
    # A scheduled request traces model times: the ranks time the forward (on a GPU, synchronizing around it).
    time_forward: bool = False


class ModelRunnerOutput(msgspec.Struct, array_like=True):
    req_ids: list[str]
    sampled_token_ids: list[int]         # one per req_ids entry; -1 where a prefill chunk sampled nothing
    logprobs: Optional[list[Optional[LogprobsEntry]]] = None
    prompt_logprobs: Optional[dict[str, "PromptLogprobsChunk"]] = None   # rows that asked, by request id
    # Rows that verified drafts: the accepted draft ids, which come before sampled_token_ids[i] (the token
    # sampled after them), and their logprobs entries where the row asked for logprobs.
    spec_token_ids: Optional[list[list[int]]] = None
    spec_logprobs: Optional[list[Optional[list[LogprobsEntry]]]] = None
    # A draft model's proposals for each row's next step (speculative method draft_model; [] for none).
    draft_token_ids: Optional[list[list[int]]] = None
    # Pooling rows whose prompt completed this step: their pooled vector (float32 bytes), None elsewhere.
    pooler_output: Optional[list[Optional[bytes]]] = None
    kv_connector_output: Optional[KVConnectorOutput] = None        # --kv-transfer-config: loads and saves done
    forward_time: Optional[float] = None     # with SchedulerOutput.time_forward: seconds of this rank's forward


class PromptLogprobsChunk(msgspec.Struct, array_like=True):
    """One step's prompt logprobs of a request: entries[j] scores prompt token start + j + 1."""
    start: int
    entries: list[LogprobsEntry]

# ---------------------------------------------------------------- executor <-> worker processes


class ExecuteModel(msgspec.Struct, array_like=True, tag="exec"):
    scheduler_output: SchedulerOutput


class WorkerCall(msgspec.Struct, array_like=True, tag="call"):
    method: str
    args: list[Any] = []                # JSON-able values (collective_rpc); tensors never cross here
    kwargs: dict[str, Any] = {}


class WorkerShutdown(msgspec.Struct, array_like=True, tag="shutdown"):
    pass


WorkerInput = Union[ExecuteModel, WorkerCall, WorkerShutdown]


class WorkerHeartbeat(msgspec.Struct, array_like=True):
    """Sent by a worker's heartbeat thread every interval, on a socket of its own."""
    rank: int


class WorkerResponse(msgspec.Struct, array_like=True, omit_defaults=True):
    rank: int
    kind: str                                   # "ready" | "result" | "refused" | "output" | "error"
    result: Union[int, float, str, bool, None, list, dict] = None
    output: Optional[ModelRunnerOutput] = None
    error: Optional[str] = None
