"""The OpenAI-compatible HTTP API (FastAPI) over one AsyncEngineClient."""
from __future__ import annotations

import asyncio
import hmac
import logging
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

import pagedserve
from pagedserve.frontend.async_client import AsyncEngineClient
from pagedserve.frontend.core_client import EngineDeadError
from pagedserve.frontend.metrics import Metrics
from pagedserve.frontend.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          ModelCard, ModelList, TokenizeRequest)
from pagedserve.frontend.serving import OpenAIServing, run_until_disconnect

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerSettings:
    served_model_name: str
    api_key: str | None = None
    max_body_bytes: int = 8 << 20


def error_response(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status,
                        content={"error": {"message": message, "type": kind, "param": param, "code": status}})


def _status_for(exc: BaseException) -> JSONResponse:
    if isinstance(exc, EngineDeadError):
        return error_response(503, f"the engine is not available: {exc}", "service_unavailable")
    if isinstance(exc, ValueError):
        message = str(exc)
        param = message.split(" ", 1)[0].rstrip(":") if message else None
        return error_response(400, message, "invalid_request_error", param)
    logger.exception("internal error", exc_info=exc)
    return error_response(500, "internal server error", "internal_server_error")


def build_app(engine: AsyncEngineClient, settings: ServerSettings) -> FastAPI:
    app = FastAPI(title="pagedserve", version=pagedserve.__version__)
    serving = OpenAIServing(engine, settings.served_model_name)
    metrics = Metrics(settings.served_model_name)
    engine.finished_hooks.append(metrics.observe_finished)
    app.state.engine, app.state.metrics = engine, metrics

    @app.middleware("http")
    async def guard(request: Request, call_next):
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return error_response(413, f"request body exceeds {settings.max_body_bytes} bytes",
                                  "invalid_request_error")
        if settings.api_key and request.url.path.startswith("/v1"):
            auth = request.headers.get("authorization", "")
            if not hmac.compare_digest(auth.encode(), f"Bearer {settings.api_key}".encode()):
                return error_response(401, "invalid or missing API key", "authentication_error")
        return await call_next(request)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        return error_response(400, message, "invalid_request_error", loc or None)

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return _status_for(exc)

    def check_model(model: str | None) -> JSONResponse | None:
        if model is not None and model != settings.served_model_name:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return None

    async def respond(request: Request, body: Any, make_jobs, full, stream) -> Response:
        if (bad := check_model(body.model)) is not None:
            return bad
        try:
            rid, jobs = make_jobs(body)
        except (ValueError, ValidationError) as exc:
            return _status_for(ValueError(str(exc)))
        if engine.is_dead:
            return _status_for(EngineDeadError(engine.client.dead or "engine is dead"))
        if body.stream:
            return StreamingResponse(stream(body, jobs, rid), media_type="text/event-stream")
        try:
            return JSONResponse(await run_until_disconnect(full(body, jobs, rid), request.is_disconnected))
        except asyncio.CancelledError:
            return Response(status_code=499)
        except Exception as exc:
            return _status_for(exc)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(request, body, serving.completion_jobs, serving.completion, serving.completion_stream)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(request, body, serving.chat_job, serving.chat, serving.chat_stream)

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=settings.served_model_name, root=engine.model_config.source.path,
                         max_model_len=engine.model_config.max_model_len)
        return ModelList(data=[card]).model_dump()

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:
            return error_response(503, f"engine unhealthy: {exc}", "service_unavailable")
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        metrics.observe_stats(engine.last_stats)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        return {"version": pagedserve.__version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        if (bad := check_model(body.model)) is not None:
            return bad
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "give exactly one of prompt or messages", "invalid_request_error", "prompt")
        if body.messages is not None:
            messages = ChatCompletionRequest(messages=body.messages).text_messages()
            tokens = engine.input_processor.apply_chat_template(messages, body.add_generation_prompt).prompt_token_ids
        else:
            tokens = engine.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        if (bad := check_model(body.model)) is not None:
            return bad
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            return error_response(400, f"tokens must be in [0, {vocab})", "invalid_request_error", "tokens")
        return JSONResponse({"prompt": engine.tokenizer.decode(body.tokens)})

    return app
