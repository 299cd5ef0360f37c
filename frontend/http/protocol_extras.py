"""The parts of OpenAI's request schemas beyond the sampling basics, and what this server does with each.

Every field of the current chat and completions schemas is accepted by name, then:
- honoured when it changes the output and is supported (logit_bias; vLLM's allowed_token_ids, bad_words,
  truncate_prompt_tokens, continue_final_message; reasoning_effort reaches the chat template);
- a no-op when it only labels, bills or caches at OpenAI (PlatformFields, shared with the Responses API), or is inert here (prediction only
  speeds OpenAI up);
- a 400 naming it when it cannot be honoured yet (audio output, ...).
Tool calling's fields are frontend/openai/protocol_tools.py's.
A field outside the schemas is a 400 too, with a "did you mean" hint when it is close to a known one.
"""
from __future__ import annotations

import difflib
from typing import Any, Optional

from pydantic import BaseModel, ConfigDict, model_validator
from pydantic_core import PydanticCustomError

from pagedserve.common.errors import RequestError
from pagedserve.frontend.multimodal.chat_parts import MEDIA_PARTS

# OpenAI's schemas allow null for these, meaning the default; here they are plain-typed with that default.
_NULL_IS_DEFAULT = ("n", "presence_penalty", "frequency_penalty", "stream", "echo", "logprobs")


def drop_nulls(data: Any, names: tuple[str, ...]) -> Any:
    """A request body without the fields of `names` that are null, so each takes its default (OpenAI's
    schemas allow null for fields this server types plainly)."""
    if isinstance(data, dict) and any(data.get(k, 0) is None for k in names):
        return {k: v for k, v in data.items() if not (v is None and k in names)}
    return data


class StrictModel(BaseModel):
    # Unknown fields are an error, never silently ignored.
    model_config = ConfigDict(extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _unknown_fields(cls, data: Any) -> Any:
        """A misspelt field fails with the name it was probably meant to be (`max_token` -> max_tokens)."""
        if not isinstance(data, dict):
            return data                   # pydantic reports the wrong type itself
        # A field spelt by its alias (Anthropic's output_config.format.schema is the field schema_) is known.
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        for key in data:
            if isinstance(key, str) and key not in known:
                close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.75)
                hint = f" (did you mean {close[0]}?)" if close else ""
                raise PydanticCustomError("extra_forbidden", "{field}: unknown field{hint}",
                                          {"field": key, "hint": hint})
        return data


class PlatformFields(StrictModel):
    """Accepted and ignored: they describe the request to OpenAI's platform, never the tokens it gets. One
    list for completions, chat and Responses (which echoes them back)."""
    user: Optional[str] = None
    metadata: Optional[dict[str, str]] = None
    service_tier: Optional[str] = None
    prompt_cache_key: Optional[str] = None
    safety_identifier: Optional[str] = None
    prompt_cache_retention: Optional[str] = None
    prompt_cache_options: Optional[dict[str, Any]] = None


class ExtraRequestFields(PlatformFields):
    """Fields both completions and chat take beyond the sampling basics."""
    store: Optional[bool] = None       # OpenAI's stored completions: nothing is stored here
    logit_bias: Optional[dict[str, float]] = None
    # vLLM's
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    truncate_prompt_tokens: Optional[int] = None

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        return drop_nulls(data, _NULL_IS_DEFAULT)

    def token_bias(self) -> Optional[dict[int, float]]:
        """logit_bias with its JSON string keys as token ids (the range is SamplingParams' to check)."""
        if self.logit_bias is None:
            return None
        bias = {}
        for key, value in self.logit_bias.items():
            try:
                bias[int(key)] = value
            except ValueError:
                raise RequestError.at("logit_bias", f"keys must be token ids (integers), got {key!r}") from None
        return bias

    def constraint_params(self) -> dict[str, Any]:
        """The SamplingParams fields these settings map to."""
        return dict(logit_bias=self.token_bias(), allowed_token_ids=self.allowed_token_ids,
                    bad_words=self.bad_words, truncate_prompt_tokens=self.truncate_prompt_tokens)


class ExtraCompletionFields(ExtraRequestFields):
    best_of: Optional[int] = None
    suffix: Optional[str] = None

    def check_supported(self, n: int) -> None:
        if self.best_of is not None and self.best_of != n:
            raise RequestError.at("best_of", f"only best_of equal to n ({n}) is supported, got {self.best_of}")
        if self.suffix:
            raise RequestError.at("suffix", "insertion (text after the completion) is not supported")


# Chat content parts taken as text; any other type (input_audio, file, ...; image_url for a text model) is refused.
_TEXT_PARTS = ("text", "refusal")


class ExtraChatFields(ExtraRequestFields):
    audio: Optional[dict[str, Any]] = None
    modalities: Optional[list[str]] = None
    prediction: Optional[dict[str, Any]] = None
    reasoning_effort: Optional[str] = None
    verbosity: Optional[str] = None
    web_search_options: Optional[dict[str, Any]] = None
    moderation: Optional[dict[str, Any]] = None
    # vLLM's
    continue_final_message: bool = False

    def check_supported(self) -> None:
        if self.audio is not None:
            raise RequestError.at("audio", "audio output is not supported (this server generates text only)")
        if self.modalities is not None and any(m != "text" for m in self.modalities):
            raise RequestError.at("modalities", f"only ['text'] is supported, got {self.modalities}")
        for name in ("verbosity", "web_search_options", "moderation"):
            if getattr(self, name) is not None:
                raise RequestError.at(name, "not supported by this server")

    def template_variables(self, chat_template_kwargs: Optional[dict[str, Any]]) -> dict[str, Any]:
        """The request's chat template variables; reasoning_effort is one (as in vLLM), for templates
        that read it."""
        variables = dict(chat_template_kwargs or {})
        if self.reasoning_effort is not None:
            variables.setdefault("reasoning_effort", self.reasoning_effort)
        return variables


def text_content(messages: list[Any], images: bool = False) -> list[dict[str, Any]]:
    """Messages as the chat template takes them: content parts joined into text. A part that is not text
    is a ValueError naming it: dropping it would answer a different question than the one asked. images (a
    multimodal model): a message with image parts keeps its parts, for frontend/multimodal/chat_parts.py."""
    out = []
    for i, message in enumerate(messages):
        d = message.model_dump(exclude_none=True)
        if "audio" in d:
            raise RequestError.at(f"messages[{i}].audio", "audio is not supported (this model takes text only)")
        parts = message.content if isinstance(message.content, list) else []
        if images and any(p.get("type") in MEDIA_PARTS for p in parts):
            out.append(d)
            continue
        if isinstance(message.content, list):
            for j, part in enumerate(message.content):
                kind = part.get("type")
                if kind not in _TEXT_PARTS:
                    raise RequestError.at(f"messages[{i}].content[{j}].type", f"content parts of type {kind!r} "
                                          "are not supported (this model takes text only)")
            d["content"] = "".join(str(p.get(p["type"], "")) for p in message.content)
        out.append(d)
    return out
