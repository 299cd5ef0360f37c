"""Processors: the frontend's side of every request, one bundle for LLM and AsyncEngineClient.

The engine's tokenizer, the input processor (prompts -> checked EngineCoreRequests) and the output processor
(EngineCoreOutputs -> RequestOutputs), all built from what the engine core said about itself (EngineInfo).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.client.input_processor import InputProcessor, PreparedRequest, ProcessedPrompt
from pagedserve.frontend.client.output_processor import OutputProcessor
from pagedserve.frontend.client.tokenizer import load_tokenizer
from pagedserve.frontend.multimodal.processor import MultiModalProcessor
from pagedserve.ipc.messages import EngineInfo


@dataclass(frozen=True)
class Processors:
    tokenizer: Any
    input: InputProcessor
    output: OutputProcessor

    @classmethod
    def from_info(cls, info: EngineInfo, chat_template: str | None = None,
                  max_media_bytes: int | None = None) -> "Processors":
        """chat_template: rendered instead of the tokenizer's own (--chat-template); max_media_bytes: one
        image's or video's most bytes (the server's --max-body-bytes; None offline: no limit)."""
        tokenizer = load_tokenizer(info.tokenizer)
        mm = (MultiModalProcessor(info, tokenizer, info.mm_processor_cache_gb, max_media_bytes)
              if info.mm_limits else None)
        return cls(tokenizer, InputProcessor(tokenizer, info, chat_template, mm), OutputProcessor(tokenizer))

    def prepare(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                priority: int = 0, lora_int_id: int = 0) -> PreparedRequest:
        """Check the request (the frontend's trust boundary: the one validation on this side) and build its
        engine requests. Nothing is tracked yet: a caller may prepare a batch and refuse it whole."""
        return self.input.make_requests(request_id, prompt, params, priority, lora_int_id=lora_int_id)

    def track(self, prepared: PreparedRequest) -> None:
        """Expect a prepared request's outputs: before any of its engine requests is sent."""
        self.output.add_request(prepared.request_id, prepared.prompt.prompt, prepared.prompt.prompt_token_ids,
                                prepared.child_ids, [r.sampling_params for r in prepared.requests])
