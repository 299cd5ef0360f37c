"""The Anthropic Messages API's requests (POST /v1/messages, /v1/messages/count_tokens), as pydantic models.

Only the outer shape is typed here; the content blocks are read, and refused with a message naming the block,
by frontend/anthropic/translate.py, which turns a request into the chat request we already serve. Bounds are
Anthropic's: max_tokens is required and at least 1, temperature and top_p lie in [0, 1].
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from pydantic import Field

from pagedserve.frontend.http.protocol_extras import StrictModel


class MessageParam(StrictModel):
    role: Literal["user", "assistant"]
    content: Union[str, list[dict[str, Any]]]


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: Optional[str] = None
    disable_parallel_tool_use: Optional[bool] = None


class Metadata(StrictModel):
    user_id: Optional[str] = None


class _PromptFields(StrictModel):
    """What both routes read: the conversation, and what the chat template renders with it."""
    model: str
    messages: list[MessageParam]
    system: Optional[Union[str, list[dict[str, Any]]]] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[ToolChoice] = None
    # Extended thinking: accepted; thinking text comes back as thinking blocks when the server runs a
    # --reasoning-parser, and budget_tokens bounds nothing beyond max_tokens here.
    thinking: Optional[dict[str, Any]] = None


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    effort: Optional[Literal["low", "medium", "high", "xhigh", "max"]] = None
    format: Optional[OutputFormat] = None


class MessagesRequest(_PromptFields):
    max_tokens: int = Field(ge=1)
    stop_sequences: Optional[list[str]] = None
    # Sampling: the SDK's current create() no longer takes these, but the API (and older SDKs, LangChain) do.
    temperature: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_p: Optional[float] = Field(None, ge=0.0, le=1.0)
    top_k: Optional[int] = Field(None, ge=0)
    stream: bool = False
    # effort reaches the chat template as reasoning_effort; format is a structured output.
    output_config: Optional[OutputConfig] = None
    # Labels, caching and platform settings at Anthropic: accepted, they change no token here (the prefix
    # cache needs no cache_control breakpoints).
    metadata: Optional[Metadata] = None
    cache_control: Optional[dict[str, Any]] = None
    service_tier: Optional[Literal["auto", "standard_only"]] = None
    inference_geo: Optional[str] = None
    speed: Optional[Literal["standard", "fast"]] = None
    user_profile_id: Optional[str] = None
    workspace_id: Optional[str] = None


class CountTokensRequest(_PromptFields):
    pass
