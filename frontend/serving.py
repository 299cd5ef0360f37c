"""OpenAI completions and chat completions on top of AsyncEngineClient (non-streaming and SSE)."""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from pagedserve.common.sampling_params import SamplingParams
from pagedserve.frontend.async_client import AsyncEngineClient
from pagedserve.frontend.errors import classify, error_payload
from pagedserve.frontend.input_processor import ProcessedPrompt
from pagedserve.frontend.outputs import CompletionOutput, Logprob, RequestOutput
from pagedserve.frontend.protocol import ChatCompletionRequest, CompletionRequest, new_id, now

logger = logging.getLogger(__name__)


@dataclass
class _Job:
    prompt: ProcessedPrompt
    params: SamplingParams
    request_id: str


async def _merge(gens: list[AsyncGenerator[RequestOutput, None]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several generators as their items arrive (one per prompt of a batch request)."""
    queue: asyncio.Queue = asyncio.Queue()
    done = object()

    async def drain(i: int, gen: AsyncGenerator[RequestOutput, None]) -> None:
        try:
            async for item in gen:
                await queue.put((i, item))
        except BaseException as exc:
            await queue.put((i, exc))
        finally:
            await queue.put((i, done))

    tasks = [asyncio.create_task(drain(i, g)) for i, g in enumerate(gens)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await queue.get()
            if item is done:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


class OpenAIServing:
    def __init__(self, engine: AsyncEngineClient, served_model_name: str) -> None:
        self.engine = engine
        self.model_name = served_model_name
        self.max_model_len = engine.model_config.max_model_len
        self.tokenizer = engine.tokenizer

    def _generators(self, jobs: list[_Job], priority: int) -> list[AsyncGenerator[RequestOutput, None]]:
        return [self.engine.generate(j.prompt, j.params, j.request_id, priority) for j in jobs]

    # ---------------------------------------------------------------- completions

    def completion_jobs(self, req: CompletionRequest) -> tuple[str, list[_Job]]:
        params = req.to_sampling_params()
        prompts: list[Any] = req.prompt if isinstance(req.prompt, list) and req.prompt and \
            not isinstance(req.prompt[0], int) else [req.prompt]
        if not prompts:
            raise ValueError("prompt must not be empty")
        rid = new_id("cmpl")
        jobs = []
        for i, p in enumerate(prompts):
            parsed = self.engine.input_processor.parse_prompt(p)
            self.engine.input_processor.validate_length(len(parsed.prompt_token_ids), params)
            jobs.append(_Job(parsed, params, f"{rid}-{i}"))
        return rid, jobs

    async def completion(self, req: CompletionRequest, jobs: list[_Job], rid: str) -> dict[str, Any]:
        n = req.n
        choices: list[dict[str, Any]] = []
        finals: dict[int, RequestOutput] = {}
        async for i, out in _merge(self._generators(jobs, req.priority)):
            if out.finished:
                finals[i] = out
        prompt_tokens = completion_tokens = 0
        for i, job in enumerate(jobs):
            out = finals[i]
            prompt_tokens += len(out.prompt_token_ids)
            for c in out.outputs:
                completion_tokens += len(c.token_ids)
                text = (self._prompt_text(job.prompt) if req.echo else "") + c.text
                choices.append({"index": i * n + c.index, "text": text, "finish_reason": c.finish_reason,
                                "stop_reason": c.stop_reason,
                                "logprobs": self._completion_logprobs(c) if req.logprobs is not None else None})
        choices.sort(key=lambda ch: ch["index"])
        return {"id": rid, "object": "text_completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": _usage(prompt_tokens, completion_tokens)}

    async def completion_stream(self, req: CompletionRequest, jobs: list[_Job], rid: str) -> AsyncIterator[str]:
        created, n = now(), req.n
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        completion_tokens = 0
        prompt_tokens = sum(len(j.prompt.prompt_token_ids) for j in jobs)
        echoed: set[tuple[int, int]] = set()        # (prompt, choice) pairs whose prompt text went out
        try:
            async for i, out in _merge(self._generators(jobs, req.priority)):
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    text = c.text
                    if req.echo and (i, c.index) not in echoed:
                        echoed.add((i, c.index))
                        text = self._prompt_text(jobs[i].prompt) + text
                    if not text and c.finish_reason is None:
                        continue
                    yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                                "choices": [{"index": i * n + c.index, "text": text,
                                             "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                                             "logprobs": self._completion_logprobs(c)
                                             if req.logprobs is not None else None}]})
        except Exception as exc:
            yield _sse(error_body(exc))
        else:
            if include_usage:
                yield _sse({"id": rid, "object": "text_completion", "created": created, "model": self.model_name,
                            "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"

    def _prompt_text(self, prompt: ProcessedPrompt) -> str:
        return prompt.prompt if prompt.prompt is not None else self.tokenizer.decode(prompt.prompt_token_ids)

    def _completion_logprobs(self, c: CompletionOutput) -> dict[str, Any] | None:
        if c.logprobs is None:
            return None
        tokens, token_lps, tops, offsets = [], [], [], []
        offset = 0
        for token_id, entry in zip(c.token_ids, c.logprobs):
            chosen = entry.get(token_id)
            text = chosen.decoded_token if chosen and chosen.decoded_token is not None else ""
            tokens.append(text)
            token_lps.append(chosen.logprob if chosen else None)
            tops.append({(lp.decoded_token or ""): lp.logprob for tid, lp in _top(entry, token_id)})
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    # ---------------------------------------------------------------- chat

    def chat_job(self, req: ChatCompletionRequest) -> tuple[str, list[_Job]]:
        prompt = self.engine.input_processor.apply_chat_template(
            req.text_messages(), req.add_generation_prompt, template_kwargs=req.chat_template_kwargs)
        default_max = self.max_model_len - len(prompt.prompt_token_ids)
        params = req.to_sampling_params(default_max_tokens=max(default_max, 1))
        self.engine.input_processor.validate_length(len(prompt.prompt_token_ids), params)
        rid = new_id("chatcmpl")
        return rid, [_Job(prompt, params, rid)]

    async def chat(self, req: ChatCompletionRequest, jobs: list[_Job], rid: str) -> dict[str, Any]:
        final = None
        async for _, out in _merge(self._generators(jobs, req.priority)):
            final = out
        assert final is not None
        choices = [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                    "logprobs": self._chat_logprobs(c) if req.logprobs else None,
                    "finish_reason": c.finish_reason, "stop_reason": c.stop_reason} for c in final.outputs]
        completion_tokens = sum(len(c.token_ids) for c in final.outputs)
        return {"id": rid, "object": "chat.completion", "created": now(), "model": self.model_name,
                "choices": choices, "usage": _usage(len(final.prompt_token_ids), completion_tokens)}

    async def chat_stream(self, req: ChatCompletionRequest, jobs: list[_Job], rid: str) -> AsyncIterator[str]:
        created = now()
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        for i in range(req.n):
            yield _sse({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                             "logprobs": None, "finish_reason": None}]})
        prompt_tokens = completion_tokens = 0
        try:
            async for _, out in _merge(self._generators(jobs, req.priority)):
                prompt_tokens = len(out.prompt_token_ids)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.text and c.finish_reason is None:
                        continue
                    delta = {"content": c.text} if c.text else {}
                    yield _sse({**base, "choices": [{"index": c.index, "delta": delta,
                                                     "logprobs": self._chat_logprobs(c) if req.logprobs else None,
                                                     "finish_reason": c.finish_reason,
                                                     "stop_reason": c.stop_reason}]})
        except Exception as exc:
            yield _sse(error_body(exc))
        else:
            if include_usage:
                yield _sse({**base, "choices": [], "usage": _usage(prompt_tokens, completion_tokens)})
        yield "data: [DONE]\n\n"

    def _chat_logprobs(self, c: CompletionOutput) -> dict[str, Any] | None:
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
                                             for _, lp in _top(entry, token_id)]})
        return {"content": content}


def _top(entry: dict[int, Logprob], sampled: int) -> list[tuple[int, Logprob]]:
    """The top-k alternatives of one position (the sampled token counts only if it is among them)."""
    return sorted(((tid, lp) for tid, lp in entry.items() if tid != sampled or (lp.rank or 0) <= len(entry) - 1),
                  key=lambda kv: kv[1].rank or 0)


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def error_body(exc: BaseException) -> dict[str, Any]:
    """The SSE error event of a stream that already answered 200: the status it would have had."""
    status, kind = classify(exc)
    if status == 500:
        logger.error("internal error in a stream", exc_info=exc)
        return error_payload(status, "internal server error", kind)
    return error_payload(status, str(exc), kind)


async def run_until_disconnect(work: Awaitable[Any], is_disconnected: Callable[[], Awaitable[bool]],
                               poll_s: float = 0.5) -> Any:
    """Await work, cancelling it (and so aborting its requests) if the HTTP client goes away."""
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=poll_s)
            if done:
                return task.result()
            if await is_disconnected():
                task.cancel()
                raise asyncio.CancelledError("client disconnected")
    finally:
        if not task.done():
            task.cancel()
