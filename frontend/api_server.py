"""The OpenAI-compatible HTTP API (FastAPI) over one AsyncEngineClient."""
from __future__ import annotations

import asyncio
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.common.errors import EngineOverloadedError
from pagedserve.common.version import __version__
from pagedserve.frontend.admission import Admission, CountedStreamingResponse
from pagedserve.frontend.async_client import AsyncEngineClient
from pagedserve.frontend.core_client import EngineDeadError
from pagedserve.frontend.errors import classify, error_payload
from pagedserve.frontend.http_guards import ApiKeyMiddleware, BodyLimitMiddleware
from pagedserve.frontend.metrics import Metrics
from pagedserve.frontend.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          ModelCard, ModelList, TokenizeRequest)
from pagedserve.frontend.server_args import ServerArgs
from pagedserve.frontend.serving import OpenAIServing, run_until_disconnect

logger = logging.getLogger(__name__)


# Paths that answer without the API key (probes, and the API's own description); every other path, including
# any route added later, requires it.
OPEN_PATHS = frozenset({"/health", "/metrics", "/version", "/openapi.json", "/docs", "/docs/oauth2-redirect",
                        "/redoc"})


# The Retry-After of a 429.
RETRY_AFTER_S = 1


def error_response(status: int, message: str, kind: str, param: str | None = None,
                   retry_after_s: int | None = None) -> JSONResponse:
    headers = {"Retry-After": str(retry_after_s)} if retry_after_s is not None else None
    return JSONResponse(status_code=status, content=error_payload(status, message, kind, param), headers=headers)


def _status_for(exc: BaseException, retry_after_s: int = RETRY_AFTER_S) -> JSONResponse:
    status, kind = classify(exc)
    if status == 429:
        return error_response(429, str(exc), kind, retry_after_s=retry_after_s)
    if status == 503:
        return error_response(503, f"the engine is not available: {exc}", kind)
    if status == 400:
        message = str(exc)
        param = message.split(" ", 1)[0].rstrip(":") if message else None
        return error_response(400, message, kind, param)
    logger.error("internal error", exc_info=exc)
    return error_response(500, "internal server error", kind)


def build_app(engine: AsyncEngineClient, settings: ServerArgs, served_model_name: str) -> FastAPI:
    app = FastAPI(title="pagedserve", version=__version__)
    serving = OpenAIServing(engine, served_model_name)
    metrics = Metrics(served_model_name)
    engine.finished_hooks.append(metrics.observe_finished)
    admission = Admission(engine, settings.max_concurrent_requests)
    app.state.engine, app.state.metrics, app.state.admission = engine, metrics, admission

    # The last added runs first: the key is checked before any of the body is read.
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=OPEN_PATHS)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        return error_response(400, message, "invalid_request_error", loc or None)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing and body-parsing errors (404, 405, undecodable body) get OpenAI's error shape too.
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    @app.exception_handler(ValueError)
    async def on_bad_value(_: Request, exc: ValueError) -> JSONResponse:
        # Registered for ValueError itself, so it is answered without the traceback Exception handlers log.
        return _status_for(exc)

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return _status_for(exc)

    def check_model(model: str | None) -> JSONResponse | None:
        if model is not None and model != served_model_name:
            return error_response(404, f"The model `{model}` does not exist.", "NotFoundError", "model")
        return None

    def refuse(reason: str, message: str) -> JSONResponse:
        metrics.rejected.labels(served_model_name, reason).inc()
        return error_response(429, message, "overloaded_error", retry_after_s=RETRY_AFTER_S)

    async def respond(request: Request, body: Any, make_jobs, full, stream) -> Response:
        if (bad := check_model(body.model)) is not None:
            return bad
        try:
            rid, jobs = await engine.run_tokenizer(make_jobs, body)
        except (ValueError, ValidationError) as exc:
            return _status_for(ValueError(str(exc)))
        if engine.is_dead:
            return _status_for(EngineDeadError(engine.client.dead or "engine is dead"))
        if (refused := admission.refusal()) is not None:
            return refuse(*refused)
        leave = admission.enter()
        if body.stream:
            return CountedStreamingResponse(stream(body, jobs, rid), leave, media_type="text/event-stream")
        try:
            return JSONResponse(await run_until_disconnect(full(body, jobs, rid), request.is_disconnected))
        except asyncio.CancelledError:
            return Response(status_code=499)
        except EngineOverloadedError as exc:
            return refuse("queue", str(exc))
        except Exception as exc:
            return _status_for(exc, RETRY_AFTER_S)
        finally:
            leave()

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await respond(request, body, serving.completion_jobs, serving.completion, serving.completion_stream)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await respond(request, body, serving.chat_job, serving.chat, serving.chat_stream)

    @app.get("/v1/models")
    async def models() -> dict:
        card = ModelCard(id=served_model_name, root=engine.model_config.source.path,
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
        return {"version": __version__}

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        if (bad := check_model(body.model)) is not None:
            return bad
        if (body.prompt is None) == (body.messages is None):
            return error_response(400, "give exactly one of prompt or messages", "invalid_request_error", "prompt")
        if body.messages is not None:
            messages = ChatCompletionRequest(messages=body.messages).text_messages()
            prompt = await engine.run_tokenizer(engine.input_processor.apply_chat_template, messages,
                                                body.add_generation_prompt)
            tokens = prompt.prompt_token_ids
        else:
            tokens = await engine.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": serving.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        if (bad := check_model(body.model)) is not None:
            return bad
        vocab = engine.model_config.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            return error_response(400, f"tokens must be in [0, {vocab})", "invalid_request_error", "tokens")
        return JSONResponse({"prompt": await engine.run_tokenizer(engine.tokenizer.decode, body.tokens)})

    return app
