"""One builder for OpenAI response bodies: completions and chat completions, whole and streamed.

The two APIs differ only in a few places (object names, `text` versus `message`/`delta`, the logprobs
format, chat's opening role chunk, completions' echo); everything else, choices, finish reasons, usage and
the stream's chunk envelope, is built once here.
"""
from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pagedserve.frontend.openai.chat_output import ChatOutputParser, finish_reason
from pagedserve.frontend.client.outputs import CompletionOutput, RequestOutput
from pagedserve.frontend.openai.prompt_logprobs import echo_logprobs, prompt_logprobs_json, top_alternatives

Api = Literal["completion", "chat"]
_OBJECTS = {("completion", False): "text_completion", ("completion", True): "text_completion",
            ("chat", False): "chat.completion", ("chat", True): "chat.completion.chunk"}


def sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict[str, Any]:
    """cached_tokens: the prompts' tokens read from the prefix cache, reported (as vLLM's
    --enable-prompt-tokens-details does) when not None."""
    body: dict[str, Any] = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                            "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        body["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return body


@dataclass
class ResponseBuilder:
    """The bodies of one HTTP request. Prompt i's sample c is choice i * n + c."""
    api: Api
    request_id: str
    model: str
    n: int
    logprobs: bool                          # the request asked for logprobs
    echo_texts: list[str] | None = None     # completions with echo: each prompt's text, put before its output
    top_logprobs: int = 0                   # k: alternatives shown per position
    echo_first_tokens: list[str] | None = None   # echo with logprobs: each prompt's first token, as text
    show_prompt_logprobs: bool = False      # the request set vLLM's prompt_logprobs: return that field
    cached_tokens_details: bool = False     # usage carries prompt_tokens_details.cached_tokens
    # chat with tools or a reasoning parser: makes each choice's ChatOutputParser (frontend/openai/chat_output.py)
    chat_parser: Callable[[], ChatOutputParser] | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    _echoed: set[int] = field(default_factory=set)
    _parsers: dict[int, ChatOutputParser] = field(default_factory=dict)

    # ---------------------------------------------------------------- whole responses

    def whole(self, finals: list[RequestOutput]) -> dict[str, Any]:
        """finals[i]: the finished output of prompt i."""
        choices = [self._choice(i, c, stream=False, out=out) for i, out in enumerate(finals) for c in out.outputs]
        choices.sort(key=lambda ch: ch["index"])
        prompt_tokens = sum(len(out.prompt_token_ids) for out in finals)
        completion_tokens = sum(len(c.token_ids) for out in finals for c in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals) if self.cached_tokens_details else None
        body = {**self._envelope(stream=False), "choices": choices,
                "usage": usage(prompt_tokens, completion_tokens, cached)}
        if self.api == "chat" and self.show_prompt_logprobs and finals[0].prompt_logprobs is not None:
            body["prompt_logprobs"] = prompt_logprobs_json(finals[0].prompt_logprobs)   # vLLM: top level in chat
        return body

    # ---------------------------------------------------------------- streams

    def opening_chunks(self) -> list[dict[str, Any]]:
        """Chat streams open with the assistant role for every choice; completion streams open with text."""
        if self.api != "chat":
            return []
        return [self.chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}]) for i in range(self.n)]

    def delta_choice(self, prompt_index: int, c: CompletionOutput,
                     out: RequestOutput | None = None) -> dict[str, Any] | None:
        """The stream choice for one delta output, or None when it carries nothing to send."""
        choice = self._choice(prompt_index, c, stream=True, out=out)
        if choice is not None and not self._has_content(choice) and c.finish_reason is None:
            return None
        return choice

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {**self._envelope(stream=True), "choices": choices}

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
        cached = cached_tokens if self.cached_tokens_details else None
        return {**self._envelope(stream=True), "choices": [], "usage": usage(prompt_tokens, completion_tokens, cached)}

    # ---------------------------------------------------------------- shared

    def _envelope(self, stream: bool) -> dict[str, Any]:
        return {"id": self.request_id, "object": _OBJECTS[(self.api, stream)], "created": self.created,
                "model": self.model}

    def _choice(self, prompt_index: int, c: CompletionOutput, stream: bool,
                out: RequestOutput | None = None) -> dict[str, Any]:
        """out: the request output c belongs to, when it may carry the prompt's logprobs."""
        index = prompt_index * self.n + c.index
        scored = out.prompt_logprobs if out is not None else None
        if self.api == "completion":
            opening = not stream or index not in self._echoed     # the chunk that echoes the prompt
            body: dict[str, Any] = {"text": self._echo(prompt_index, index, stream) + c.text}
            logprobs = self._completion_logprobs(prompt_index, c, out if opening else None) \
                if self.logprobs else None
            if self.show_prompt_logprobs and scored is not None:
                body["prompt_logprobs"] = prompt_logprobs_json(scored)
        else:
            body, reason = self._chat_body(index, c, stream)
            logprobs = chat_logprobs(c, self.top_logprobs) if self.logprobs else None
            return {"index": index, **body, "logprobs": logprobs, "finish_reason": reason,
                    "stop_reason": c.stop_reason}
        return {"index": index, **body, "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason}

    def _chat_body(self, index: int, c: CompletionOutput, stream: bool) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message (or delta) and finish reason: "tool_calls" when it called tools."""
        if self.chat_parser is None:
            text = {"content": c.text} if c.text else {}
            return ({"delta": text} if stream else {"message": {"role": "assistant", "content": c.text}}), \
                c.finish_reason
        parser = self._parsers.setdefault(index, self.chat_parser())
        if not stream:
            message = parser.message(c.text)
            return {"message": message}, finish_reason(c.finish_reason, bool(message.get("tool_calls")))
        delta = parser.delta(c.text, final=c.finish_reason is not None)
        return {"delta": delta}, finish_reason(c.finish_reason, parser.called)

    def _echo(self, prompt_index: int, choice_index: int, stream: bool) -> str:
        """The prompt's text before a choice's first text (once per choice in a stream)."""
        if self.echo_texts is None or (stream and choice_index in self._echoed):
            return ""
        self._echoed.add(choice_index)
        return self.echo_texts[prompt_index]

    def _completion_logprobs(self, prompt_index: int, c: CompletionOutput,
                             out: RequestOutput | None) -> dict[str, Any] | None:
        """With echo, the prompt's positions first (their logprobs arrive once, in `out`), then c's tokens."""
        generated = _completion_logprobs(c, self.top_logprobs)
        if self.echo_first_tokens is None or out is None or out.prompt_logprobs is None:
            return generated
        columns = echo_logprobs(out.prompt_token_ids, self.echo_first_tokens[prompt_index], out.prompt_logprobs,
                                self.top_logprobs)
        if generated is not None:
            shift = sum(len(t) for t in columns["tokens"])
            generated["text_offset"] = [o + shift for o in generated["text_offset"]]
            for name, values in generated.items():
                columns[name].extend(values)
        return columns

    @staticmethod
    def _has_content(choice: dict[str, Any]) -> bool:
        return bool(choice.get("text") or choice.get("delta"))


def _completion_logprobs(c: CompletionOutput, k: int) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(c.token_ids, c.logprobs):
        chosen = entry.get(token_id)
        text = chosen.decoded_token if chosen and chosen.decoded_token is not None else ""
        tokens.append(text)
        token_lps.append(chosen.logprob if chosen else None)
        tops.append({(lp.decoded_token or ""): lp.logprob for _, lp in top_alternatives(entry, k)})
        offsets.append(offset)
        offset += len(text)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}


def chat_logprobs(c: CompletionOutput, k: int) -> dict[str, Any] | None:
    if c.logprobs is None:
        return None
    content = []
    for token_id, entry in zip(c.token_ids, c.logprobs):
        chosen = entry.get(token_id)
        text = chosen.decoded_token if chosen and chosen.decoded_token is not None else ""
        content.append({"token": text, "logprob": chosen.logprob if chosen else None,
                        "bytes": list(text.encode("utf-8")),
                        "top_logprobs": [{"token": lp.decoded_token or "", "logprob": lp.logprob,
                                          "bytes": list((lp.decoded_token or "").encode("utf-8"))}
                                         for _, lp in top_alternatives(entry, k)]})
    return {"content": content}
