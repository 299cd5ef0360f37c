"""OpenAI completions and chat completions over AsyncEngineClient.

Every endpoint follows one flow: parse (pydantic, before this code runs) -> validate and build the engine
requests (`_completion_requests` / `_chat_requests`: tokenize, template, check against the engine's limits)
-> run (`_run`: admission, then the whole response or the stream). Any error before the run is a plain
exception that the app's handlers turn into an OpenAI-shaped status; once a stream has answered 200 its
errors become an error event.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, Union

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagedserve.common.params.beam_search_params import BeamSearchParams
from pagedserve.common.errors import EngineOverloadedError, RequestError, error_field
from pagedserve.frontend.http.admission import Admission, CountedStreamingResponse
from pagedserve.frontend.client.async_client import AsyncEngineClient
from pagedserve.frontend.beam_search.serving import beam_search_outputs
from pagedserve.frontend.openai.chat_output import chat_parser_factory
from pagedserve.frontend.http.errors import ModelNotFoundError, classify, error_payload
from pagedserve.frontend.client.input_processor import PreparedRequest, ProcessedPrompt
from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.frontend.openai.protocol import ChatCompletionRequest, CompletionRequest
from pagedserve.frontend.beam_search.protocol import check_beam_params
from pagedserve.frontend.openai.protocol_structured import name_field
from pagedserve.frontend.openai.bodies import SSE_DONE, ResponseBuilder, sse, usage
from pagedserve.frontend.lora.serving import LoRAModels
from pagedserve.frontend.parsers.tool_parsers import TOOL_PARSERS

logger = logging.getLogger(__name__)
GenerationRequest = Union[CompletionRequest, ChatCompletionRequest]


class OpenAIServing:
    def __init__(self, engine: AsyncEngineClient, served_model_name: str, admission: Admission,
                 tool_parser: str | None = None, loras: LoRAModels | None = None,
                 prompt_tokens_details: bool = False) -> None:
        """tool_parser: --tool-call-parser when --enable-auto-tool-choice is on (tool_choice auto allowed);
        loras: the adapters served by name (--enable-lora); prompt_tokens_details:
        --enable-prompt-tokens-details (usage reports the prompt's cached tokens)."""
        self.engine = engine
        self.prompt_tokens_details = prompt_tokens_details
        self.tool_parser = tool_parser
        self.model_name = served_model_name
        self.admission = admission
        self.loras = loras

    def check_model(self, model: str | None) -> int:
        """The LoRA adapter id the request's model names (0: the base model); 404 for a model not served."""
        lora = self.loras.lora_id(model) if self.loras is not None else \
            (0 if model is None or model == self.model_name else None)
        if lora is None:
            raise ModelNotFoundError(f"The model `{model}` does not exist.")
        return lora

    # ---------------------------------------------------------------- endpoints

    async def completions(self, body: CompletionRequest, http: Request) -> Response:
        lora = self.check_model(body.model)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.use_beam_search:
            return await self._beam_completions(body, http, rid, lora)
        jobs = await self._completion_requests(body, rid, lora)
        echo = [j.prompt.prompt if j.prompt.prompt is not None else await self.engine.detokenize(
            j.prompt.prompt_token_ids) for j in jobs] if body.echo else None
        first_tokens = [await self.engine.detokenize(j.prompt.prompt_token_ids[:1]) for j in jobs] \
            if body.echo and body.logprobs is not None else None
        builder = ResponseBuilder("completion", rid, body.model if lora else self.model_name, body.n,
                                  body.logprobs is not None, echo, top_logprobs=body.logprobs or 0,
                                  echo_first_tokens=first_tokens,
                                  show_prompt_logprobs=body.prompt_logprobs is not None,
                                  cached_tokens_details=self.prompt_tokens_details)
        return await self._run(http, body, jobs, builder)

    async def chat(self, body: ChatCompletionRequest, http: Request) -> Response:
        lora = self.check_model(body.model)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        tool_mode = body.check_tools(auto_enabled=self.tool_parser is not None)
        builder = ResponseBuilder("chat", rid, body.model if lora else self.model_name, body.n, body.logprobs,
                                  top_logprobs=body.top_logprobs or 0,
                                  show_prompt_logprobs=body.prompt_logprobs is not None,
                                  cached_tokens_details=self.prompt_tokens_details,
                                  chat_parser=chat_parser_factory(tool_mode, self.tool_parser,
                                                                  self.engine.info.reasoning_parser))
        if body.use_beam_search:
            return await self._beam_chat(body, http, rid, tool_mode, lora, builder)
        jobs = await self._chat_requests(body, rid, tool_mode, lora)
        return await self._run(http, body, jobs, builder)

    # ---------------------------------------------------------------- beam search (frontend/beam_search/serving.py)

    async def _beam_completions(self, body: CompletionRequest, http: Request, rid: str, lora: int) -> Response:
        params = self._beam_params(body, body.max_tokens)
        if not body.prompt_list():
            raise RequestError("prompt", "prompt must not be empty")
        prompts = [await self.engine.tokenize(p) for p in body.prompt_list()]
        builder = ResponseBuilder("completion", rid, body.model if lora else self.model_name, params.beam_width, False)
        return await self._respond(http, body, lambda: beam_search_outputs(
            self.engine, rid, prompts, params, body.priority, lora), builder)

    async def _beam_chat(self, body: ChatCompletionRequest, http: Request, rid: str, tool_mode: str | None,
                         lora: int, builder: ResponseBuilder) -> Response:
        if tool_mode not in (None, "auto"):       # a forced call is a grammar, which beams cannot follow
            raise RequestError.at("tool_choice", "only none or auto is supported with use_beam_search")
        params = self._beam_params(body, body.max_completion_tokens if body.max_completion_tokens is not None
                                   else body.max_tokens)
        prompt = await self._render_chat(body)
        return await self._respond(http, body, lambda: beam_search_outputs(
            self.engine, rid, [prompt], params, body.priority, lora), builder)

    def _beam_params(self, body: GenerationRequest, max_tokens: int | None) -> BeamSearchParams:
        params = body.to_beam_search_params(max_tokens, self.engine.info.max_model_len)
        check_beam_params(params, len(self.engine.info.eos_token_ids))
        return params

    # ---------------------------------------------------------------- validate and build

    async def _completion_requests(self, body: CompletionRequest, rid: str, lora: int = 0) -> list[PreparedRequest]:
        params = body.to_sampling_params(defaults=self.engine.info.default_sampling)
        prompts = body.prompt_list()
        if not prompts:
            raise RequestError("prompt", "prompt must not be empty")
        return [self.engine.prepare(await self.engine.tokenize(p), params, f"{rid}-{i}", body.priority, lora)
                for i, p in enumerate(prompts)]

    async def _chat_requests(self, body: ChatCompletionRequest, rid: str,
                             tool_mode: str | None = None, lora: int = 0) -> list[PreparedRequest]:
        prompt = await self._render_chat(body)
        # max_tokens unset stays None: the request fills what its prompt, once truncated in prepare, leaves.
        params = body.to_sampling_params(defaults=self.engine.info.default_sampling)
        if tool_mode == "auto" and TOOL_PARSERS[self.tool_parser].keeps_special_tokens:
            params = params.clone(skip_special_tokens=False)     # its call marker is a special token
        return [self.engine.prepare(prompt, params, rid, body.priority, lora)]

    async def _render_chat(self, body: ChatCompletionRequest) -> ProcessedPrompt:
        body.check_supported()      # before rendering: a field we cannot honour is the error to report
        messages = body.text_messages(images=self.engine.is_multimodal)
        return await self.engine.render_chat(messages, body.add_generation_prompt,
                                             body.template_variables(body.chat_template_kwargs),
                                             body.continue_final_message, tools=body.template_tools())

    # ---------------------------------------------------------------- run

    async def _run(self, http: Request, body: GenerationRequest, jobs: list[PreparedRequest],
                   builder: ResponseBuilder) -> Response:
        self.engine.check_alive()
        self.admission.check()
        leave = self.admission.enter()
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            # vLLM's continuous_usage_stats: every chunk also carries its choice's usage so far
            continuous = include_usage and body.stream_options.continuous_usage_stats
            try:
                outputs = await self._first_output(body, jobs)
            except BaseException:
                leave()
                raise
            return CountedStreamingResponse(self._stream(jobs, builder, include_usage, outputs, continuous), leave,
                                            media_type="text/event-stream")
        try:
            return await self._whole_response(http, body, self._whole(jobs, builder))
        finally:
            leave()

    async def _respond(self, http: Request, body: GenerationRequest,
                       run: Callable[[], Awaitable[list[RequestOutput]]], builder: ResponseBuilder) -> Response:
        """The whole response of work other than one engine request per prompt (beam search): run() gives
        each prompt's finished output."""
        self.engine.check_alive()
        self.admission.check()
        leave = self.admission.enter()

        async def whole() -> dict[str, Any]:
            return builder.whole(await run())
        try:
            return await self._whole_response(http, body, whole())
        finally:
            leave()

    async def _whole_response(self, http: Request, body: GenerationRequest,
                              work: Awaitable[dict[str, Any]]) -> Response:
        try:
            return JSONResponse(await run_until_disconnect(work, http.is_disconnected))
        except asyncio.CancelledError:
            return Response(status_code=499)
        except EngineOverloadedError as exc:      # the core refused it in a race with the check above
            self.admission.count_refusal("queue")
            raise exc
        except ValueError as exc:
            raise name_field(exc, body.structured_outputs_source()) from None

    async def _final_output(self, job: PreparedRequest) -> RequestOutput:
        """A request run to its end: its finished output."""
        final: RequestOutput | None = None
        async for out in self.engine.stream(job):
            if out.finished:
                final = out
        return final

    async def _serve_one(self, http: Request, chat: ChatCompletionRequest, job: PreparedRequest, stream: bool,
                         events: Callable[[AsyncIterator[Any]], AsyncIterator[str]],
                         whole: Callable[[], Awaitable[dict[str, Any]]],
                         field_error: Callable[[ValueError], Exception]) -> Response:
        """One request of a second API over chat (Responses, Anthropic Messages): admitted, then streamed as
        `events` of its outputs or answered whole; a bad field is raised as that API's `field_error`."""
        self.engine.check_alive()
        self.admission.check()
        leave = self.admission.enter()
        if stream:
            try:
                outputs = await self._first_output(chat, [job])
            except ValueError as exc:
                leave()
                raise field_error(exc) from None
            except BaseException:
                leave()
                raise
            return CountedStreamingResponse(events(outputs), leave, media_type="text/event-stream")
        try:
            return JSONResponse(await run_until_disconnect(whole(), http.is_disconnected))
        except asyncio.CancelledError:
            return Response(status_code=499)
        except EngineOverloadedError:        # the core refused it in a race with the check above
            self.admission.count_refusal("queue")
            raise
        except ValueError as exc:
            raise field_error(name_field(exc, chat.structured_outputs_source())) from None
        finally:
            leave()

    async def _first_output(self, body: GenerationRequest,
                            jobs: list[PreparedRequest]) -> AsyncIterator[tuple[int, RequestOutput]] | None:
        """A stream under a grammar answers 200 only once the grammar compiled: a spec that does not is a
        400, as without streaming. Returns the outputs with the first one put back, or None (no grammar)."""
        if all(j.params.structured_outputs is None for j in jobs):
            return None
        outputs = merge_streams([self.engine.stream(j) for j in jobs])
        try:
            first = await outputs.__anext__()
        except ValueError as exc:
            raise name_field(exc, body.structured_outputs_source()) from None
        return _prepend(first, outputs)

    async def _whole(self, jobs: list[PreparedRequest], builder: ResponseBuilder) -> dict[str, Any]:
        finals: dict[int, RequestOutput] = {}
        async for i, out in merge_streams([self.engine.stream(j) for j in jobs]):
            if out.finished:
                finals[i] = out
        return builder.whole([finals[i] for i in range(len(jobs))])

    async def _stream(self, jobs: list[PreparedRequest], builder: ResponseBuilder, include_usage: bool,
                      outputs: AsyncIterator[tuple[int, RequestOutput]] | None = None,
                      continuous: bool = False) -> AsyncIterator[str]:
        for chunk in builder.opening_chunks():        # chat's role chunks: one prompt, nothing made yet
            yield sse({**chunk, "usage": usage(len(jobs[0].prompt.prompt_token_ids), 0)} if continuous else chunk)
        prompt_tokens = sum(len(j.prompt.prompt_token_ids) for j in jobs)
        completion_tokens = 0
        cached: dict[int, int] = {}         # per prompt: its prefix-cache hit, known from its first output
        made: dict[tuple[int, int], int] = {}   # per (prompt, choice): its tokens so far (continuous usage)
        try:
            async for i, out in outputs or merge_streams([self.engine.stream(j) for j in jobs]):
                cached[i] = max(cached.get(i, 0), out.num_cached_tokens)
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    made[i, c.index] = made.get((i, c.index), 0) + len(c.token_ids)
                    if (choice := builder.delta_choice(i, c, out)) is None:
                        continue
                    chunk = builder.chunk([choice])
                    if continuous:
                        chunk["usage"] = usage(len(jobs[i].prompt.prompt_token_ids), made[i, c.index])
                    yield sse(chunk)
        except Exception as exc:
            yield sse(error_body(exc))
        else:
            if include_usage:
                yield sse(builder.usage_chunk(prompt_tokens, completion_tokens, sum(cached.values())))
        yield SSE_DONE


async def _prepend(first: Any, rest: AsyncGenerator[Any, None]) -> AsyncIterator[Any]:
    try:
        yield first
        async for item in rest:
            yield item
    finally:
        await rest.aclose()       # a client that left: cancel the engine requests now, not at GC


async def merge_streams(gens: list[AsyncGenerator[RequestOutput, None]]) -> AsyncIterator[tuple[int, RequestOutput]]:
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


def error_body(exc: BaseException) -> dict[str, Any]:
    """The SSE error event of a stream that already answered 200: the status it would have had."""
    status, kind = classify(exc)
    if status == 500:
        logger.error("internal error in a stream", exc_info=exc)
        return error_payload(status, "internal server error", kind)
    return error_payload(status, str(exc), kind, error_field(exc))


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
