"""A request as the engine core tracks it: tokens, progress, status."""
from __future__ import annotations

import enum
import time
from typing import Any

import msgspec

from pagedserve.core.block_hash import BlockHasher
from pagedserve.common.multimodal.families import PLACEMENT_TENSORS
from pagedserve.common.params.pooling_params import PoolingParams
from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.ipc.messages import EngineCoreEvent, EngineCoreOutput, LogprobsEntry, MultiModalFeature, PromptLogprobsChunk, TensorData


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    WAITING_FOR_GRAMMAR = 3     # its structured-output grammar is still compiling (vLLM's WAITING_FOR_FSM)
    WAITING_FOR_REMOTE_KVS = 4  # a KV connector is loading blocks for it (core/kv_connector/waiting.py)
    # Everything from here on is finished.
    FINISHED_STOPPED = 10
    FINISHED_LENGTH_CAPPED = 11
    FINISHED_ABORTED = 12
    FINISHED_ERROR = 13

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


class Request:
    def __init__(self, request_id: str, prompt_token_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: tuple[int, ...], max_tokens: int, block_hasher: BlockHasher | None,
                 arrival_time: float | None = None, priority: int = 0, client_index: int = 0,
                 lora_int_id: int = 0, lora_digest: bytes | None = None,
                 pooling_params: PoolingParams | None = None, whole_prompt: bool = False,
                 mm_features: list[MultiModalFeature] | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.sampling_params = sampling_params
        self.eos_token_ids = () if sampling_params.ignore_eos else eos_token_ids
        self.max_tokens = max_tokens
        self.arrival_time = time.time() if arrival_time is None else arrival_time
        self.priority = priority
        self.client_index = client_index
        self.output_token_ids: list[int] = []
        self.all_token_ids: list[int] = list(prompt_token_ids)
        self.num_computed_tokens = 0
        # Tokens scheduled to be sampled whose ids have not come back yet (async scheduling keeps up to two
        # steps of them): the request counts them as its own when the next step is scheduled.
        self.num_output_placeholders = 0
        self.num_cached_tokens = -1       # prefix-cache hit at first scheduling; -1 until then
        self.num_preemptions = 0
        self.first_scheduled_time: float | None = None    # for the queue-time metric
        self.queue_time_reported = False
        # Its scheduling moments not yet sent (traces: --collect-detailed-traces); a few per request.
        self._events: list[EngineCoreEvent] = [EngineCoreEvent("QUEUED", self._since_arrival())]
        self.status = RequestStatus.WAITING
        self.stop_reason: int | None = None
        self.block_hashes: list[bytes] = []
        # core.structured_output.StructuredOutputRequest when the request has structured_outputs
        self.structured: Any = None
        self.num_prompt_logprobs_sent = 0   # prompt positions already reported (a preempted request rescores)
        self.spec_token_ids: list[int] = []  # a draft model's proposals for the next step (method draft_model)
        # Its recent draft positions verified and accepted, decayed (core/spec_decode/state.py SpecDecodeState.acceptance)
        self.spec_hits = self.spec_trials = 0.0
        self.lora_int_id = lora_int_id          # 0: the base model
        # Its KV may be stored and loaded across processes (a KV connector): not under weights updated in this
        # process, whose version number means nothing to another (EngineCore.add_request sets it).
        self.persistent_kv = True
        self._lora_digest = lora_digest         # the adapter's identity in the prefix cache
        self._hasher = block_hasher
        # A pooling request: its prompt is computed and pooled, never decoded (max_tokens is 0). whole_prompt:
        # the pooler reads every prompt position in one step, so the prompt is never chunked.
        self.pooling_params = pooling_params
        self.whole_prompt = whole_prompt
        # Its images, in prompt order, with their processed data (sent to the workers when encoded).
        self.mm_features: list[MultiModalFeature] = mm_features or []
        # The same without their pixels: what the workers are told with the request (pixels go with its encode;
        # the small grids stay, the workers' M-RoPE positions are computed from them).
        self.mm_placements = [msgspec.structs.replace(f, data=placement_data(f.data))
                              for f in self.mm_features] or None
        self._stop_ids = frozenset(self.eos_token_ids) | frozenset(sampling_params.stop_token_ids or ())
        self._update_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        self._update_hashes()

    def check_stop(self, max_model_len: int) -> RequestStatus | None:
        """The finished status after the last appended token, or None to keep going."""
        last = self.output_token_ids[-1]
        if self.num_output_tokens >= self.sampling_params.min_tokens and last in self._stop_ids:
            if last not in self.eos_token_ids:
                self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= self.max_tokens or self.num_tokens >= max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def mark_scheduled(self) -> None:
        """Admitted to run: first from waiting, or again after a preemption."""
        if self.first_scheduled_time is None:
            self.first_scheduled_time = time.time()
        self._events.append(EngineCoreEvent("SCHEDULED", self._since_arrival()))

    def note_preempted(self) -> None:
        self.num_preemptions += 1
        self._events.append(EngineCoreEvent("PREEMPTED", self._since_arrival()))

    def stamp_timing(self, out: EngineCoreOutput) -> None:
        """The output carries the queue time (the first output only) and the events since the last one."""
        out.queue_time = self.take_queue_time()
        if self._events:
            out.events, self._events = self._events, []

    def _since_arrival(self) -> float:
        return max(0.0, time.time() - self.arrival_time)

    def take_queue_time(self) -> float | None:
        """Seconds from arrival (the frontend's clock) to first scheduled, on the request's first output only."""
        if self.first_scheduled_time is None or self.queue_time_reported:
            return None
        self.queue_time_reported = True
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    def take_prompt_logprobs(self, chunk: PromptLogprobsChunk | None) -> list[LogprobsEntry] | None:
        """The entries of a step's prompt-logprobs chunk not reported before, in prompt order."""
        if chunk is None:
            return None
        fresh = chunk.entries[max(0, self.num_prompt_logprobs_sent - chunk.start):]
        self.num_prompt_logprobs_sent = max(self.num_prompt_logprobs_sent, chunk.start + len(chunk.entries))
        return fresh or None

    def _update_hashes(self) -> None:
        if self._hasher is not None:
            self._hasher.extend(self.block_hashes, self.all_token_ids, self._lora_digest, self.mm_features)

    def sort_key(self) -> tuple[int, float]:
        return (self.priority, self.arrival_time)


def placement_data(data: dict[str, TensorData] | None) -> dict[str, TensorData] | None:
    """An item's tensors the workers keep with its placement (families.PLACEMENT_TENSORS); None: none."""
    kept = {name: tensor for name, tensor in (data or {}).items() if name in PLACEMENT_TENSORS}
    return kept or None
