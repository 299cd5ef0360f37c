"""OpenAI-compatible request/response schemas (plus vLLM's extra sampling fields)."""
from __future__ import annotations

import time
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field

from pagedserve.common.errors import RequestError
from pagedserve.common.params.sampling_params import RequestOutputKind, SamplingParams, check_logprobs
from pagedserve.frontend.beam_search.protocol import BeamSearchFields
from pagedserve.frontend.http.protocol_extras import (ExtraChatFields, ExtraCompletionFields, ExtraRequestFields,
                                                 StrictModel, text_content)
from pagedserve.frontend.openai.protocol_structured import StructuredOutputFields
from pagedserve.frontend.openai.protocol_tools import ToolFields, template_messages


class StreamOptions(StrictModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = True    # a no-op: there is no padding to obfuscate lengths with


class _SamplingFields(ExtraRequestFields, StructuredOutputFields, BeamSearchFields):
    model: Optional[str] = None
    n: int = Field(1, ge=1, le=128)     # OpenAI's bound; each sample is a queue entry in the engine
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stop: Optional[Union[str, list[str]]] = None
    seed: Optional[int] = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    # vLLM's extra fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: Optional[list[int]] = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    priority: int = 0
    prompt_logprobs: Optional[int] = None   # vLLM: score the prompt's tokens too

    def _params(self, max_tokens: Optional[int], logprobs: Optional[int],
                defaults: Optional[dict[str, Any]] = None,
                prompt_logprobs: Optional[int] = None) -> SamplingParams:
        # Unset fields take the model's generation-config defaults, then SamplingParams' own.
        d = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "repetition_penalty": 1.0,
             **(defaults or {})}
        return SamplingParams(
            n=self.n, temperature=d["temperature"] if self.temperature is None else self.temperature,
            top_p=d["top_p"] if self.top_p is None else self.top_p,
            top_k=d["top_k"] if self.top_k is None else self.top_k,
            min_p=d["min_p"] if self.min_p is None else self.min_p, presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            repetition_penalty=d["repetition_penalty"] if self.repetition_penalty is None
            else self.repetition_penalty,
            seed=self.seed, max_tokens=max_tokens, min_tokens=self.min_tokens, stop=self.stop,
            stop_token_ids=self.stop_token_ids, include_stop_str_in_output=self.include_stop_str_in_output,
            ignore_eos=self.ignore_eos, logprobs=logprobs, skip_special_tokens=self.skip_special_tokens,
            prompt_logprobs=self.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            output_kind=RequestOutputKind.DELTA if self.stream else RequestOutputKind.FINAL_ONLY,
            structured_outputs=self.structured_outputs_params(), **self.constraint_params())


class CompletionRequest(_SamplingFields, ExtraCompletionFields):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: Optional[int] = 16
    logprobs: Optional[int] = None
    echo: bool = False

    def prompt_list(self) -> list[Union[str, list[int]]]:
        """The prompts of this request: one string or id list, or a batch of them."""
        if isinstance(self.prompt, list) and self.prompt and not isinstance(self.prompt[0], int):
            return list(self.prompt)
        return [self.prompt]

    def to_sampling_params(self, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        check_logprobs("logprobs", self.logprobs)
        self.check_supported(self.n)
        if self.max_tokens == 0 and not self.echo:
            raise RequestError("max_tokens", "max_tokens must be at least 1 (0 is allowed only with echo=true: the "
                               "prompt alone)")
        # echo with logprobs shows the prompt's tokens with their logprobs (what evaluation harnesses read).
        echoed = max(self.logprobs, self.prompt_logprobs or 0) if self.echo and self.logprobs is not None else None
        return self._params(self.max_tokens, self.logprobs, defaults, echoed)


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")   # tool calls, names etc. pass through to the template
    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(ToolFields, _SamplingFields, ExtraChatFields):
    messages: list[ChatMessage]
    max_tokens: Optional[int] = None
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None
    add_generation_prompt: bool = True
    chat_template_kwargs: Optional[dict[str, Any]] = None

    def to_sampling_params(self, defaults: Optional[dict[str, Any]] = None) -> SamplingParams:
        """max_tokens left unset stays None: the request may fill what its prompt (once truncated) leaves."""
        if self.top_logprobs is not None and not self.logprobs:
            raise RequestError("top_logprobs", "top_logprobs requires logprobs to be true")
        check_logprobs("top_logprobs", self.top_logprobs)
        max_tokens = self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens
        if max_tokens is not None and max_tokens < 1:
            raise RequestError("max_tokens", f"max_tokens must be at least 1, got {max_tokens}")
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return self._params(max_tokens, logprobs, defaults)

    def text_messages(self, images: bool = False) -> list[dict[str, Any]]:
        """images: the model takes images, and a message's image parts are kept (chat_parts.take_images)."""
        return template_messages(text_content(self.messages, images))


class TokenizeRequest(StrictModel):
    model: Optional[str] = None
    prompt: Optional[str] = None
    messages: Optional[list[ChatMessage]] = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Optional[list[dict[str, Any]]] = None      # rendered by the chat template, as in chat requests


class DetokenizeRequest(StrictModel):
    model: Optional[str] = None
    tokens: list[int]


class UsageInfo(BaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


def now() -> int:
    return int(time.time())


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: Optional[str] = None
    code: Optional[int] = None


class ErrorResponse(BaseModel):
    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=now)
    owned_by: str = "pagedserve"
    root: Optional[str] = None
    parent: Optional[str] = None          # a LoRA adapter's base model
    max_model_len: Optional[int] = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
