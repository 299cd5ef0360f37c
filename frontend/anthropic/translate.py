"""An Anthropic Messages request as the chat completion request it is, so that rendering, sampling, tool forcing
and output parsing stay the chat path's (frontend/openai/serving.py).

- `system` (a string or text blocks) is the first, system, message.
- A user turn's `tool_result` blocks become tool messages (before the rest of the turn, as they answer the
  calls of the assistant turn before); its text and image blocks stay one user message.
- An assistant turn's `tool_use` blocks become its tool_calls; `thinking` blocks are left out (chat templates
  drop past thinking). A last assistant turn is a prefill: the answer continues it.
- `tools` are function tools; tool_choice auto, any, tool and none are chat's auto, required, named and none.
Errors the chat checks raise name chat fields; `anthropic_field` renames them to the fields the user sent.
"""
from __future__ import annotations

import json
from typing import Any, Optional, Union

from pagedserve.common.errors import RequestError
from pagedserve.frontend.anthropic.protocol import CountTokensRequest, MessagesRequest, ToolChoice
from pagedserve.frontend.openai.protocol import ChatCompletionRequest

AnthropicRequest = Union[MessagesRequest, CountTokensRequest]
# Chat field -> the Anthropic field it came from, for the names in error messages.
_FIELD_NAMES = (("stop", "stop_sequences"), ("max_completion_tokens", "max_tokens"),
                ("response_format", "output_config.format"))
_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def chat_request(body: AnthropicRequest) -> ChatCompletionRequest:
    messages = [*system_message(body.system), *chat_messages(body)]
    prefill = bool(body.messages) and body.messages[-1].role == "assistant"
    fields: dict[str, Any] = dict(messages=messages, model=body.model, tools=chat_tools(body.tools),
                                  add_generation_prompt=not prefill, continue_final_message=prefill,
                                  **chat_tool_choice(body.tool_choice))
    if isinstance(body, MessagesRequest):
        config = body.output_config
        fields.update(max_tokens=body.max_tokens, stop=body.stop_sequences, temperature=body.temperature,
                      top_p=body.top_p, top_k=body.top_k, stream=body.stream,
                      reasoning_effort=config.effort if config else None,
                      response_format={"type": "json_schema", "json_schema": {"name": "output", "schema":
                                                                              config.format.schema_}}
                      if config and config.format else None)
    return ChatCompletionRequest(**fields)


def system_message(system: Optional[Union[str, list[dict[str, Any]]]]) -> list[dict[str, Any]]:
    if system is None:
        return []
    text = system if isinstance(system, str) else "\n".join(_text_block(b, f"system[{i}]")
                                                            for i, b in enumerate(system))
    return [{"role": "system", "content": text}] if text else []


def chat_messages(body: AnthropicRequest) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, message in enumerate(body.messages):
        where = f"messages[{i}].content"
        blocks = [{"type": "text", "text": message.content}] if isinstance(message.content, str) \
            else message.content
        if message.role == "user":
            out += _user_turn(blocks, where)
        else:
            out.append(_assistant_turn(blocks, where))
    return out


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[dict[str, Any]]:
    results, parts = [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "tool_result":
            results.append(_tool_result(block, f"{where}[{j}]"))
        elif kind in ("text", "image"):
            parts.append(_part(block, f"{where}[{j}]"))
        else:
            raise RequestError.at(f"{where}[{j}].type", f"blocks of type {kind!r} are not supported in a user turn "
                                                        "(text, image, tool_result)")
    return results + ([{"role": "user", "content": parts}] if parts else [])


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> dict[str, Any]:
    parts, calls = [], []
    for j, block in enumerate(blocks):
        kind = _kind(block, f"{where}[{j}]")
        if kind == "text":
            parts.append(_part(block, f"{where}[{j}]"))
        elif kind == "tool_use":
            calls.append(_tool_use(block, f"{where}[{j}]"))
        elif kind not in ("thinking", "redacted_thinking"):
            raise RequestError.at(f"{where}[{j}].type", f"blocks of type {kind!r} are not supported in an assistant "
                                                        "turn (text, tool_use, thinking)")
    message: dict[str, Any] = {"role": "assistant", "content": parts or None}
    if calls:
        message["tool_calls"] = calls
    return message


def _kind(block: Any, where: str) -> str:
    if not isinstance(block, dict) or not isinstance(block.get("type"), str):
        raise RequestError.at(f"{where}.type", "a content block is an object with a type")
    return block["type"]


def _text_block(block: Any, where: str) -> str:
    if _kind(block, where) != "text" or not isinstance(block.get("text"), str):
        raise RequestError.at(where, 'must be a text block {"type": "text", "text": ...}')
    return block["text"]


def _part(block: dict[str, Any], where: str) -> dict[str, Any]:
    """A text or image block as a chat content part (images go the multimodal path as data: or http URLs)."""
    if block["type"] == "text":
        return {"type": "text", "text": _text_block(block, where)}
    source = block.get("source")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64":
        media, data = source.get("media_type"), source.get("data")
        if media not in _IMAGE_TYPES:
            raise RequestError.at(f"{where}.source.media_type", f"must be one of {', '.join(_IMAGE_TYPES)}")
        if not isinstance(data, str) or not data:
            raise RequestError.at(f"{where}.source.data", "base64 image data is required")
        return {"type": "image_url", "image_url": {"url": f"data:{media};base64,{data}"}}
    if kind == "url" and isinstance(source.get("url"), str):
        return {"type": "image_url", "image_url": {"url": source["url"]}}
    raise RequestError.at(f"{where}.source", 'an image source is {"type": "base64", "media_type", "data"} or '
                                             '{"type": "url", "url"}')


def _tool_use(block: dict[str, Any], where: str) -> dict[str, Any]:
    for key in ("id", "name"):
        if not isinstance(block.get(key), str) or not block[key]:
            raise RequestError.at(f"{where}.{key}", "a non-empty string is required")
    if not isinstance(block.get("input"), dict):
        raise RequestError.at(f"{where}.input", "an object is required")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"], ensure_ascii=False)}}


def _tool_result(block: dict[str, Any], where: str) -> dict[str, Any]:
    if not isinstance(block.get("tool_use_id"), str) or not block["tool_use_id"]:
        raise RequestError.at(f"{where}.tool_use_id", "a non-empty string is required")
    content = block.get("content", "")
    if isinstance(content, list):
        content = "\n".join(_text_block(b, f"{where}.content[{k}]") for k, b in enumerate(content))
    elif not isinstance(content, str):
        raise RequestError.at(f"{where}.content", "must be a string or a list of text blocks")
    return {"role": "tool", "tool_call_id": block["tool_use_id"], "content": content}


def chat_tools(tools: Optional[list[dict[str, Any]]]) -> Optional[list[dict[str, Any]]]:
    """Custom tools ({"name", "description", "input_schema"}) as chat function tools; Anthropic's server
    tools (web_search, bash, text_editor, ...) run at Anthropic and are refused."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type", "custom")
        if kind != "custom":
            raise RequestError.at(f"tools[{i}].type", f"tools of type {kind!r} are not supported (server tools run "
                                                      "at Anthropic; this server takes custom tools)")
        if not isinstance(tool.get("input_schema"), dict):
            raise RequestError.at(f"tools[{i}].input_schema", "a JSON Schema object is required")
        fn = {"name": tool.get("name"), "parameters": tool["input_schema"]}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: Optional[ToolChoice]) -> dict[str, Any]:
    """tool_choice and parallel_tool_calls as chat takes them (unset: chat's default, auto with tools)."""
    if choice is None:
        return {}
    fields: dict[str, Any] = {}
    if choice.disable_parallel_tool_use:
        fields["parallel_tool_calls"] = False
    if choice.type == "tool":
        if not choice.name:
            raise RequestError.at("tool_choice.name", 'required with {"type": "tool"}')
        fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
    else:
        fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
    return fields


def anthropic_field(exc: ValueError) -> ValueError:
    """A chat-path error as one naming the Anthropic field (stop -> stop_sequences, parameters ->
    input_schema, ...)."""
    field = getattr(exc, "field", None)
    if not isinstance(exc, RequestError) or field is None:
        return exc
    new = field
    for chat, ours in _FIELD_NAMES:
        if field == chat or field.startswith(chat + "."):
            new = ours + field[len(chat):]
    if field.startswith("tools[") and ".function." in field:
        new = field.replace(".function.parameters", ".input_schema", 1).replace(".function.", ".", 1)
    message = exc.message.replace(field, new, 1)
    if field == "tool_choice":          # chat's name for Anthropic's "any"
        message = message.replace("'required'", "'any'")
    return exc if message == exc.message else RequestError(new, message)
