"""The OpenAI Responses API: POST /v1/responses, GET /v1/responses/{id}, POST /v1/responses/{id}/cancel.

A response runs as the chat completion it translates to (frontend/responses/protocol.py): the same rendering,
sampling, tool forcing, structured output and output parsing, and the same admission, disconnect and error
handling (OpenAIServing). What is its own: the output items, the typed stream (frontend/responses/stream.py)
and the store of finished responses (frontend/responses/store.py) that `previous_response_id` chains from.
"""
from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any, Optional

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.common.errors import RequestError
from pagedserve.frontend.openai.chat_output import ChatOutputParser, chat_parser_factory
from pagedserve.frontend.http.errors import error_payload
from pagedserve.frontend.client.input_processor import PreparedRequest
from pagedserve.frontend.client.outputs import CompletionOutput, RequestOutput
from pagedserve.frontend.openai.protocol import ChatCompletionRequest
from pagedserve.frontend.openai.bodies import chat_logprobs
from pagedserve.frontend.responses.items import ResponseEnvelope, output_items, status_of, usage
from pagedserve.frontend.responses.protocol import ResponsesRequest, responses_field
from pagedserve.frontend.responses.store import ResponseNotFoundError, ResponsesStore, StoredResponse
from pagedserve.frontend.responses.stream import ResponseEvents, sse_event
from pagedserve.frontend.server_args import ServerArgs
from pagedserve.frontend.openai.serving import OpenAIServing, error_body, merge_streams


class _Turn:
    """One response being made: what it was asked, how its text is read, where it is stored."""

    def __init__(self, body: ResponsesRequest, chat: ChatCompletionRequest, job: PreparedRequest,
                 envelope: ResponseEnvelope, parser: ChatOutputParser, conversation: list[dict[str, Any]]) -> None:
        self.body, self.chat, self.job, self.envelope = body, chat, job, envelope
        self.parser, self.conversation = parser, conversation

    def logprobs(self, c: CompletionOutput) -> Optional[list[dict[str, Any]]]:
        if not self.body.wants_logprobs():
            return None
        return (chat_logprobs(c, self.body.top_logprobs or 0) or {"content": []})["content"]


class ResponsesServing(OpenAIServing):
    def __init__(self, chat: OpenAIServing, store: ResponsesStore) -> None:
        super().__init__(chat.engine, chat.model_name, chat.admission, chat.tool_parser, chat.loras)
        self.store = store

    # ---------------------------------------------------------------- endpoints

    async def create(self, body: ResponsesRequest, http: Request) -> Response:
        lora = self.check_model(body.model)
        history = self.store.get(body.previous_response_id, "previous_response_id").conversation \
            if body.previous_response_id is not None else []
        envelope = ResponseEnvelope(body, body.model if lora else self.model_name)
        try:
            chat = body.chat_request(history)
            tool_mode = chat.check_tools(auto_enabled=self.tool_parser is not None)
            [job] = await self._chat_requests(chat, envelope.id, tool_mode, lora)
        except ValueError as exc:
            raise responses_field(exc) from None
        make = chat_parser_factory(tool_mode, self.tool_parser, self.engine.info.reasoning_parser)
        turn = _Turn(body, chat, job, envelope, make() if make else ChatOutputParser(None, None),
                     [*history, *body.input_items()])
        return await self._run_turn(http, turn)

    def retrieve(self, response_id: str) -> dict[str, Any]:
        return self.store.get(response_id).body

    def cancel(self, response_id: str) -> dict[str, Any]:
        """As vLLM: only a background response can be cancelled, and every stored one here has finished."""
        self.store.get(response_id)
        raise RequestError("response_id", "Cannot cancel a synchronous response.")

    # ---------------------------------------------------------------- run

    async def _run_turn(self, http: Request, turn: _Turn) -> Response:
        return await self._serve_one(http, turn.chat, turn.job, turn.body.stream,
                                     lambda outputs: self._events(turn, outputs), lambda: self._whole(turn),
                                     responses_field)

    async def _whole(self, turn: _Turn) -> dict[str, Any]:
        final = await self._final_output(turn.job)
        c = final.outputs[0]
        items = output_items(turn.parser.message(c.text), turn.logprobs(c))
        reasoning = next((i["content"][0]["text"] for i in items if i["type"] == "reasoning"), "")
        status, incomplete = status_of(c.finish_reason)
        body = turn.envelope.body(status, items, await self._usage(final, len(c.token_ids), reasoning), incomplete)
        self._keep(turn, body, items)
        return body

    async def _events(self, turn: _Turn,
                      outputs: Optional[AsyncIterator[tuple[int, RequestOutput]]]) -> AsyncIterator[str]:
        events = ResponseEvents(turn.envelope)
        for event in events.opening():
            yield sse_event(event)
        generated, reasoning, pending = 0, "", []       # pending: logprobs of tokens whose text is held back
        final: Optional[RequestOutput] = None
        try:
            async for _, out in outputs or merge_streams([self.engine.stream(turn.job)]):
                c = out.outputs[0]
                generated += len(c.token_ids)
                pending += turn.logprobs(c) or []
                delta = turn.parser.delta(c.text, final=c.finish_reason is not None)
                reasoning += delta.get("reasoning_content") or ""
                for event in events.delta(delta, pending if delta.get("content") else []):
                    yield sse_event(event)
                if delta.get("content"):
                    pending = []
                final = out if out.finished else final
        except Exception as exc:
            error = error_body(exc)["error"]
            yield sse_event(events.event("error", code=error["type"], message=error["message"],
                                         param=error["param"]))
            return
        for event in events.closing():
            yield sse_event(event)
        status, incomplete = status_of(final.outputs[0].finish_reason)
        last = events.final(status, await self._usage(final, generated, reasoning), incomplete)
        self._keep(turn, last["response"], events.output)
        yield sse_event(last)

    # ---------------------------------------------------------------- shared

    async def _usage(self, final: RequestOutput, generated: int, reasoning: str) -> dict[str, Any]:
        # The parser splits text, not tokens: the reasoning's tokens are its text re-tokenized.
        reasoning_tokens = len((await self.engine.tokenize(reasoning, add_special_tokens=False)).prompt_token_ids) \
            if reasoning else 0
        return usage(len(final.prompt_token_ids), generated, final.num_cached_tokens, reasoning_tokens)

    def _keep(self, turn: _Turn, body: dict[str, Any], items: list[dict[str, Any]]) -> None:
        if turn.body.store:
            self.store.put(body["id"], StoredResponse(body, [*turn.conversation, *items]))


def add_responses_routes(app: FastAPI, chat: OpenAIServing, settings: ServerArgs) -> None:
    """The Responses API's routes, over the chat serving's engine, admission and parsers."""
    serving = ResponsesServing(chat, ResponsesStore(settings.responses_store_max_entries,
                                                    settings.responses_store_ttl))
    app.state.responses = serving

    @app.exception_handler(ResponseNotFoundError)
    async def not_found(_: Request, exc: ResponseNotFoundError) -> JSONResponse:
        return JSONResponse(status_code=404, content=error_payload(404, str(exc), "invalid_request_error", exc.field))

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request) -> Response:
        return await serving.create(body, request)

    @app.get("/v1/responses/{response_id}")
    async def retrieve(response_id: str) -> Response:
        return JSONResponse(serving.retrieve(response_id))

    @app.post("/v1/responses/{response_id}/cancel")
    async def cancel(response_id: str) -> Response:
        return JSONResponse(serving.cancel(response_id))
