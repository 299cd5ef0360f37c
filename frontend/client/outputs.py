"""What users get back: RequestOutput / CompletionOutput, shaped like vLLM's."""
from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve.ipc.messages import EngineCoreEvent


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None       # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None   # the stop string or stop token id that ended it

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    error_kind: str | None = None          # with error: "invalid" (never runnable) | "overloaded" (retry later)
    # With SamplingParams.prompt_logprobs: None for the first prompt token, then one dict per prompt token.
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    error_field: str | None = None         # with error: the request field at fault, when one is
    pooling_output: bytes | None = None    # a pooling request's answer: float32 values (frontend/pooling/requests.py)
    # On the finished output: the engine core's scheduling moments of all its samples, in the order they came.
    events: list[EngineCoreEvent] = field(default_factory=list)
