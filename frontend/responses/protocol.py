"""The Responses API request (POST /v1/responses) and its translation into the chat request we already serve.

A Responses request is a chat request in another shape: `input` items become chat messages, function tools and
tool_choice become chat's, `text.format` becomes `response_format`, `max_output_tokens` becomes `max_tokens`.
So this file only checks what the chat path cannot honour (built-in tools, background runs, non-text input) and
translates; rendering, sampling, tool forcing and structured output are the chat path's (frontend/openai/serving.py).
Errors the chat checks raise name chat fields; `responses_field` renames them to the fields the user sent.
"""
from __future__ import annotations

import json
from typing import Any, Literal, Optional, Union

from pydantic import Field, model_validator

from pagedserve.common.errors import RequestError
from pagedserve.common.params.sampling_params import MAX_LOGPROBS
from pagedserve.frontend.openai.protocol import ChatCompletionRequest
from pagedserve.frontend.http.protocol_extras import PlatformFields, drop_nulls

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# include values that ask for nothing this server makes: there is no encrypted reasoning to return.
_INERT_INCLUDES = frozenset({"reasoning.encrypted_content"})
# Content part types read as text; input_image is kept for a multimodal model; any other (input_file,
# input_audio) is refused.
_TEXT_PARTS = frozenset({"input_text", "output_text", "text", "refusal", "reasoning_text", "summary_text"})
_ROLES = frozenset({"user", "system", "developer", "assistant"})
# Chat field -> the Responses field it came from, for the names in error messages.
_FIELD_NAMES = (("response_format", "text.format"), ("max_tokens", "max_output_tokens"), ("messages", "input"))


# OpenAI's schema allows null for these, meaning the default.
_NULL_IS_DEFAULT = ("store", "stream", "background", "priority")


class ResponsesRequest(PlatformFields):
    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    previous_response_id: Optional[str] = None
    store: bool = True                 # OpenAI's default
    stream: bool = False
    background: bool = False
    include: Optional[list[str]] = None
    # sampling
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_logprobs: Optional[int] = Field(None, ge=0, le=MAX_LOGPROBS)
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    # vLLM's extra sampling fields
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    priority: int = 0
    # tools, output format, reasoning
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Union[str, dict[str, Any]]] = None
    parallel_tool_calls: Optional[bool] = None
    max_tool_calls: Optional[int] = None
    text: Optional[dict[str, Any]] = None
    reasoning: Optional[dict[str, Any]] = None
    truncation: Optional[Literal["auto", "disabled"]] = None
    # labels and platform settings (user, metadata, ...): PlatformFields', accepted and echoed
    stream_options: Optional[dict[str, Any]] = None
    # refused: no server-side conversations, stored prompts or context compaction here
    conversation: Optional[Union[str, dict[str, Any]]] = None
    prompt: Optional[dict[str, Any]] = None
    context_management: Optional[list[dict[str, Any]]] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_nulls(data, _NULL_IS_DEFAULT)

    # ---------------------------------------------------------------- checks

    def check_supported(self) -> None:
        """A RequestError naming the field this server cannot honour."""
        if self.background:
            raise RequestError.at("background", "background responses are not supported (this server answers "
                                                "each request in its connection)")
        for name in ("conversation", "prompt", "context_management"):
            if getattr(self, name) is not None:
                raise RequestError.at(name, "not supported by this server")
        for value in self.include or []:
            if value != LOGPROBS_INCLUDE and value not in _INERT_INCLUDES:
                raise RequestError.at("include", f"{value!r} is not supported (only {LOGPROBS_INCLUDE!r})")
        if self.max_output_tokens is not None and self.max_output_tokens < 1:
            raise RequestError.at("max_output_tokens", f"must be at least 1, got {self.max_output_tokens}")
        if self.top_logprobs and not self.wants_logprobs():
            raise RequestError.at("top_logprobs", f"needs include [{LOGPROBS_INCLUDE!r}]")

    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or [])

    # ---------------------------------------------------------------- translation

    def chat_request(self, history: list[dict[str, Any]]) -> ChatCompletionRequest:
        """The chat request this one is: `history` (the chained previous response's conversation items)
        then `input`, after the instructions."""
        self.check_supported()
        messages = ([{"role": "system", "content": self.instructions}] if self.instructions else []) + \
            chat_messages([*history, *self.input_items()])
        tool_fields = {"tools": chat_tools(self.tools), "tool_choice": chat_tool_choice(self.tool_choice),
                       "parallel_tool_calls": self.parallel_tool_calls}
        return ChatCompletionRequest(
            messages=messages, model=self.model, max_tokens=self.max_output_tokens, temperature=self.temperature,
            top_p=self.top_p, seed=self.seed, stop=self.stop, top_k=self.top_k, min_p=self.min_p,
            repetition_penalty=self.repetition_penalty, priority=self.priority, stream=self.stream,
            logprobs=self.wants_logprobs(), top_logprobs=self.top_logprobs if self.wants_logprobs() else None,
            response_format=chat_response_format(self.text), reasoning_effort=(self.reasoning or {}).get("effort"),
            **tool_fields)

    def input_items(self) -> list[dict[str, Any]]:
        """`input` as items (a string is one user message), each checked and in one normal form, as stored
        for a later previous_response_id."""
        if isinstance(self.input, str):
            return [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": self.input}]}]
        return [_input_item(item, f"input[{i}]") for i, item in enumerate(self.input)]


def _input_item(item: dict[str, Any], where: str) -> dict[str, Any]:
    kind = item.get("type", "message")
    if kind == "message":
        role = item.get("role")
        if role not in _ROLES:
            raise RequestError.at(f"{where}.role", f"must be one of {', '.join(sorted(_ROLES))}, got {role!r}")
        part = "output_text" if role == "assistant" else "input_text"
        content = item.get("content")
        if role == "user" and isinstance(content, list) and any(isinstance(p, dict) and p.get("type") == "input_image"
                                                                for p in content):
            return {"type": "message", "role": role,
                    "content": [_image_or_text(p, f"{where}.content[{j}]") for j, p in enumerate(content)]}
        return {"type": "message", "role": role,
                "content": [{"type": part, "text": _text(item.get("content"), f"{where}.content")}]}
    if kind == "function_call":
        for key in ("call_id", "name", "arguments"):
            if not isinstance(item.get(key), str):
                raise RequestError.at(f"{where}.{key}", "a string is required")
        try:
            json.loads(item["arguments"] or "{}")       # checked here, where its item can be named
        except ValueError:
            raise RequestError.at(f"{where}.arguments", "not valid JSON") from None
        return {k: item[k] for k in ("type", "call_id", "name", "arguments", "id") if k in item}
    if kind == "function_call_output":
        output = item.get("output")
        if not isinstance(item.get("call_id"), str):
            raise RequestError.at(f"{where}.call_id", "a string is required")
        text = output if isinstance(output, str) else _text(output, f"{where}.output")
        return {"type": kind, "call_id": item["call_id"], "output": text}
    if kind == "reasoning":
        return {"type": kind, "content": item.get("content") or [], "summary": item.get("summary") or []}
    raise RequestError.at(f"{where}.type", f"input items of type {kind!r} are not supported (message, "
                                           "function_call, function_call_output, reasoning)")


def _image_or_text(part: Any, where: str) -> dict[str, Any]:
    """A user message's part in normal form: an input_image by its URL (data:, http(s)://, file://), else text."""
    if isinstance(part, dict) and part.get("type") == "input_image":
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise RequestError.at(f"{where}.image_url", "an image URL is required (file_id is not supported)")
        return {"type": "input_image", "image_url": url}
    return {"type": "input_text", "text": _text([part], where)}


def _chat_content(content: Any) -> Any:
    """A normal-form message's content as chat takes it: text, or chat parts where it holds images."""
    if isinstance(content, list) and any(p.get("type") == "input_image" for p in content):
        return [{"type": "image_url", "image_url": {"url": p["image_url"]}} if p["type"] == "input_image"
                else {"type": "text", "text": p["text"]} for p in content]
    return _text(content, "input")


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise RequestError.at(where, "must be a string or a list of content parts")
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else part
            raise RequestError.at(f"{where}[{j}].type", f"content parts of type {kind!r} are not supported "
                                                        "(this model takes text only)")
    return "".join(str(p.get("text", p.get("refusal", ""))) for p in content)


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Normal-form items as chat messages: calls join the assistant turn before them (parallel calls are one
    turn), outputs become tool messages, reasoning items are left out (chat templates drop past thinking)."""
    messages: list[dict[str, Any]] = []
    for item in items:
        kind = item["type"]
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _chat_content(item["content"])})
        elif kind == "function_call":
            call = {"id": item["call_id"], "type": "function",
                    "function": {"name": item["name"], "arguments": item["arguments"]}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item["call_id"], "content": item["output"]})
    return messages


def chat_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Responses function tools ({"type": "function", "name", "parameters", ...}) in chat's shape."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise RequestError("tools", f"tools[{i}]: tools of type {kind!r} are not supported (built-in tools "
                                        "such as web_search, file_search or code_interpreter run at OpenAI; this "
                                        "server takes function tools)")
        out.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                     if k in ("name", "description", "parameters")}})
    return out


def chat_tool_choice(choice: Optional[Union[str, dict[str, Any]]]) -> Optional[Union[str, dict[str, Any]]]:
    if choice is None or isinstance(choice, str):
        return choice
    if choice.get("type") != "function":
        raise RequestError.at("tool_choice", f"choices of type {choice.get('type')!r} are not supported "
                                             '(none, auto, required or {"type": "function", "name": ...})')
    return {"type": "function", "function": {"name": choice.get("name")}}


def chat_response_format(text: Optional[dict[str, Any]]) -> Optional[dict[str, Any]]:
    """text.format as chat's response_format (where the structured-output path reads it)."""
    fmt = (text or {}).get("format")
    if fmt is None or not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return fmt
    spec = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": spec}


def responses_field(exc: ValueError) -> ValueError:
    """A chat-path error as one naming the Responses field (response_format -> text.format, ...)."""
    field = getattr(exc, "field", None)
    if not isinstance(exc, RequestError) or field is None:
        return exc
    for chat, ours in _FIELD_NAMES:
        if field == chat or field.startswith(chat + ".") or field.startswith(chat + "["):
            new = ours + field[len(chat):]
            return RequestError(new, exc.message.replace(field, new, 1))
    if field.startswith("tools[") and ".function." in field:
        new = field.replace(".function.", ".", 1)
        return RequestError(new, exc.message.replace(field, new, 1))
    return exc
