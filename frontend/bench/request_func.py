"""One streamed request to an OpenAI-compatible server, timed as vLLM's benchmark times it.

TTFT is the time to the first chunk that carries output, ITL the gaps between such chunks, E2EL the time to
the last one. A chunk carries output when it has text, or empty text with no finish reason (a token that
decodes to nothing, as vLLM counts it); a chunk with only a role (llama-server's first chat chunk; vLLM's and
ours add empty content to it, sent before any token) or only a
finish reason and usage (its last one) carries none, and counting them would move TTFT and E2EL.
"""
from __future__ import annotations

import codecs
import dataclasses
import json
import time
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import aiohttp


@dataclasses.dataclass
class RequestInput:
    api_url: str
    model: str
    prompt: list[int] | str
    prompt_len: int
    output_len: int
    ignore_eos: bool
    chat: bool = False
    extra_body: dict[str, Any] | None = None


@dataclasses.dataclass
class RequestOutput:
    success: bool = False
    generated_text: str = ""
    output_tokens: int | None = None      # the server's usage.completion_tokens, when it says
    ttft: float = 0.0
    itl: list[float] = dataclasses.field(default_factory=list)
    latency: float = 0.0
    start_time: float = 0.0
    prompt_len: int = 0
    error: str = ""


class SSEParser:
    """Server-sent events out of arbitrary byte chunks: the `data:` payload of each complete event."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")()
        self._buffer = ""

    def feed(self, data: bytes) -> list[str]:
        self._buffer += self._decoder.decode(data)
        self._buffer = self._buffer.replace("\r\n", "\n")
        events = []
        while "\n\n" in self._buffer:
            event, self._buffer = self._buffer.split("\n\n", 1)
            lines = [line[5:].lstrip() for line in event.split("\n") if line.startswith("data:")]
            if lines:                                # comments (": ping") and other fields carry no data
                events.append("\n".join(lines))
        return events


def build_payload(req: RequestInput) -> dict[str, Any]:
    # Greedy: every engine then does the same sampling work (none to speak of); --extra-body overrides it.
    payload: dict[str, Any] = {"model": req.model, "stream": True, "stream_options": {"include_usage": True},
                               "max_tokens": req.output_len, "temperature": 0.0}
    if req.chat:
        payload["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        payload["prompt"] = req.prompt
    if req.ignore_eos:
        payload["ignore_eos"] = True                # vLLM's and llama-server's extension
    payload.update(req.extra_body or {})
    return payload


def _chunk_text(choice: dict[str, Any], chat: bool) -> str | None:
    if chat:
        delta = choice.get("delta") or {}
        # An opening chunk (the role, with empty content: vLLM's and ours) is sent before any token is.
        return None if "role" in delta and not delta.get("content") else delta.get("content")
    return choice.get("text")


async def send_request(req: RequestInput, session: aiohttp.ClientSession,
                       headers: dict[str, str]) -> RequestOutput:
    """Streams one request; a failure (HTTP status, transport, no output) is an unsuccessful output with
    the reason, never an exception: one bad request must not end a run."""
    out = RequestOutput(prompt_len=req.prompt_len)
    parser = SSEParser()
    text: list[str] = []
    start = last = time.perf_counter()
    out.start_time = start
    try:
        async with session.post(req.api_url, json=build_payload(req), headers=headers) as response:
            if response.status != 200:
                body = (await response.text())[:500]
                out.error = f"HTTP {response.status}: {body}"
                return out
            async for data in response.content.iter_any():
                for event in parser.feed(data):
                    if event == "[DONE]":
                        continue
                    message = json.loads(event)
                    usage = message.get("usage")
                    if usage and usage.get("completion_tokens") is not None:
                        out.output_tokens = int(usage["completion_tokens"])
                    if usage and usage.get("prompt_tokens") is not None:
                        out.prompt_len = int(usage["prompt_tokens"])     # chat: the template's tokens too
                    for choice in message.get("choices") or []:
                        piece = _chunk_text(choice, req.chat)
                        if not piece and (piece is None or choice.get("finish_reason") is not None):
                            continue
                        now = time.perf_counter()
                        if text:
                            out.itl.append(now - last)
                        else:
                            out.ttft = now - start
                        last = now
                        text.append(piece)
    except Exception:                               # noqa: BLE001 - reported per request, as vLLM does
        out.error = traceback.format_exc(limit=3)
        return out
    out.generated_text = "".join(text)
    out.latency = last - start
    out.success = bool(text)
    if not out.success:
        out.error = "the stream carried no output"
    return out
