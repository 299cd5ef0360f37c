"""The Anthropic Messages API: POST /v1/messages and POST /v1/messages/count_tokens.

A message runs as the chat completion it translates to (frontend/anthropic/translate.py): the same rendering,
sampling, tool forcing and output parsing, and the same admission, disconnect and error handling
(OpenAIServing). What is its own: the content blocks and stop reasons (content.py), the event stream
(stream.py) and the error shape (errors.py).
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Awaitable
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.frontend.anthropic.content import content_blocks, message_body, new_id, stop_reason, usage
from pagedserve.frontend.anthropic.errors import AnthropicErrorsMiddleware, anthropic_error, stream_error
from pagedserve.frontend.anthropic.protocol import CountTokensRequest, MessagesRequest
from pagedserve.frontend.anthropic.stream import MessageEvents, sse_event
from pagedserve.frontend.anthropic.translate import anthropic_field, chat_request
from pagedserve.frontend.client.input_processor import PreparedRequest
from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.frontend.http.errors import classify
from pagedserve.frontend.openai.chat_output import ChatOutputParser, chat_parser_factory
from pagedserve.frontend.openai.protocol import ChatCompletionRequest
from pagedserve.frontend.openai.serving import OpenAIServing, error_body, merge_streams

logger = logging.getLogger(__name__)


class _Turn:
    """One message being made: its chat request, engine request, and how its text is read."""

    def __init__(self, message_id: str, chat: ChatCompletionRequest, job: PreparedRequest, model: str,
                 parser: ChatOutputParser) -> None:
        self.id, self.chat, self.job, self.model, self.parser = message_id, chat, job, model, parser


class AnthropicServing(OpenAIServing):
    def __init__(self, chat: OpenAIServing) -> None:
        super().__init__(chat.engine, chat.model_name, chat.admission, chat.tool_parser, chat.loras)

    # ---------------------------------------------------------------- endpoints

    async def create(self, body: MessagesRequest, http: Request) -> Response:
        lora = self.check_model(body.model)
        message_id = new_id("msg")
        try:
            chat = chat_request(body)
            tool_mode = chat.check_tools(auto_enabled=self.tool_parser is not None)
            [job] = await self._chat_requests(chat, message_id, tool_mode, lora)
        except ValueError as exc:
            raise anthropic_field(exc) from None
        make = chat_parser_factory(tool_mode, self.tool_parser, self.engine.info.reasoning_parser)
        turn = _Turn(message_id, chat, job, body.model, make() if make else ChatOutputParser(None, None))
        return await self._run_turn(http, turn)

    async def count_tokens(self, body: CountTokensRequest) -> dict[str, int]:
        """The prompt's tokens as the chat template renders it, tools included (what input_tokens plus
        cache_read_input_tokens of the same request would be)."""
        self.check_model(body.model)
        try:
            chat = chat_request(body)
            chat.check_tools(auto_enabled=True)     # counting needs no tool parser
            prompt = await self._render_chat(chat)
        except ValueError as exc:
            raise anthropic_field(exc) from None
        return {"input_tokens": len(prompt.prompt_token_ids)}

    # ---------------------------------------------------------------- run

    async def _run_turn(self, http: Request, turn: _Turn) -> Response:
        return await self._serve_one(http, turn.chat, turn.job, turn.chat.stream,
                                     lambda outputs: self._events(turn, outputs), lambda: self._whole(turn),
                                     anthropic_field)

    async def _whole(self, turn: _Turn) -> dict[str, Any]:
        final = await self._final_output(turn.job)
        c = final.outputs[0]
        message = turn.parser.message(c.text)
        reason, sequence = stop_reason(c, bool(message.get("tool_calls")))
        return message_body(turn.id, turn.model, content_blocks(message), reason, sequence,
                            usage(len(final.prompt_token_ids), len(c.token_ids), final.num_cached_tokens))

    async def _events(self, turn: _Turn,
                      outputs: Optional[AsyncIterator[tuple[int, RequestOutput]]]) -> AsyncIterator[str]:
        events = MessageEvents(turn.id, turn.model)
        generated, final, started = 0, None, False
        try:
            async for _, out in outputs or merge_streams([self.engine.stream(turn.job)]):
                if not started:     # the first output: the prompt is in, and its cache hit known
                    started = True
                    yield sse_event(events.start(usage(len(out.prompt_token_ids), 0, out.num_cached_tokens)))
                c = out.outputs[0]
                generated += len(c.token_ids)
                for event in events.delta(turn.parser.delta(c.text, final=c.finish_reason is not None)):
                    yield sse_event(event)
                final = out if out.finished else final
        except Exception as exc:
            yield sse_event(stream_error(error_body(exc)))
            return
        if final is None:           # the engine ended the stream without a finished output
            return
        reason, sequence = stop_reason(final.outputs[0], turn.parser.called)
        for event in events.finish(reason, sequence, usage(len(final.prompt_token_ids), generated,
                                                           final.num_cached_tokens)):
            yield sse_event(event)


def add_anthropic_routes(app: FastAPI, chat: OpenAIServing) -> None:
    """The Messages API's routes, over the chat serving's engine, admission and parsers, with Anthropic's
    error shape on them (outermost: it reshapes the API key's 401 and the body limit's 413 too)."""
    serving = AnthropicServing(chat)
    app.add_middleware(AnthropicErrorsMiddleware)

    @app.post("/v1/messages")
    async def messages(body: MessagesRequest, request: Request) -> Response:
        return await _answer(serving.create(body, request))

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: CountTokensRequest) -> Response:
        return await _answer(serving.count_tokens(body))


async def _answer(work: Awaitable[Any]) -> Response:
    """The route's answer. An expected refusal (a 4xx, 429, 503) goes to the app's handlers, whose answer the
    middleware reshapes; an unexpected error is answered here, since the app's catch-all handler runs outside
    every middleware."""
    try:
        result = await work
    except Exception as exc:
        if classify(exc)[0] != 500:
            raise
        logger.error("internal error", exc_info=exc)
        status, body = anthropic_error(500, "internal server error")
        return JSONResponse(body, status_code=status)
    return result if isinstance(result, Response) else JSONResponse(result)
