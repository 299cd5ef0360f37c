"""The OpenAI-compatible HTTP API (FastAPI) over one AsyncEngineClient: routes and error mapping only.

Generation endpoints hand over to OpenAIServing at once; the small endpoints answer here from the engine's
narrow face (`info`, `tokenize`, `render_chat`, `detokenize`, `check_health`, `last_stats`).
"""
from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve.common import envs
from pagedserve.common.errors import RequestError, error_field
from pagedserve.common.version import __version__
from pagedserve.frontend.http.admission import Admission
from pagedserve.frontend.client.async_client import AsyncEngineClient
from pagedserve.frontend.client.core_client import EngineDeadError
from pagedserve.frontend.dp.client import DataParallelClient
from pagedserve.frontend.dp.elastic import ElasticScaler
from pagedserve.frontend.dp.elastic_routes import add_elastic_routes
from pagedserve.frontend.http.drain import Drain, DrainMiddleware
from pagedserve.frontend.rl.dev_routes import add_dev_routes
from pagedserve.frontend.http.errors import ModelNotFoundError, classify, error_payload
from pagedserve.frontend.http.guards import ApiKeyMiddleware, BodyLimitMiddleware
from pagedserve.frontend.lora.serving import LoRAModels, LoRAModule, add_lora_routes, parse_lora_modules
from pagedserve.frontend.http.metrics import Metrics
from pagedserve.frontend.openai.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest,
                                          ModelCard, ModelList, TokenizeRequest)
from pagedserve.frontend.anthropic.serving import add_anthropic_routes
from pagedserve.frontend.responses.serving import add_responses_routes
from pagedserve.frontend.server_args import ServerArgs
from pagedserve.frontend.tracing.request_spans import RequestSpans
from pagedserve.frontend.tracing.trace_headers import TraceHeadersMiddleware
from pagedserve.frontend.openai.serving import OpenAIServing
from pagedserve.frontend.pooling.serving import add_pooling_routes

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


def response_for(exc: BaseException, retry_after_s: int = RETRY_AFTER_S) -> JSONResponse:
    """The HTTP answer to an exception raised while handling a request."""
    status, kind = classify(exc)
    if status == 429:
        return error_response(429, str(exc), kind, retry_after_s=retry_after_s)
    if status == 503:
        return error_response(503, f"the engine is not available: {exc}", kind)
    if status == 404:
        return error_response(404, str(exc), kind, "model")
    if status == 400:
        return error_response(400, str(exc), kind, error_field(exc))
    logger.error("internal error", exc_info=exc)
    return error_response(500, "internal server error", kind)


def _lifespan(loras: LoRAModels | None, modules: list[LoRAModule],
              spans: RequestSpans | None) -> Callable[[FastAPI], AbstractAsyncContextManager[None]]:
    """The app's startup: --lora-modules load before the server takes requests (a refused one stops the
    start, with the reason). At its end the spans still queued are sent; the engine's shutdown is the
    caller's: the engine outlives the app (cli.serve)."""
    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        for module in modules:
            await loras.load(module)
        yield
        if spans is not None:
            spans.shutdown()
    return lifespan


def _request_spans(engine: AsyncEngineClient, settings: ServerArgs, served_model_name: str) -> RequestSpans | None:
    """--otlp-traces-endpoint: a span per request; without it no hook is installed and nothing imported."""
    if not settings.otlp_traces_endpoint:
        return None
    spans = RequestSpans(settings.otlp_traces_endpoint, served_model_name, settings.collect_detailed_traces)
    engine.started_hooks.append(spans.begin)
    engine.finished_hooks.append(spans.finish)
    engine.unfinished_hooks.append(spans.drop)
    return spans


def build_app(engine: AsyncEngineClient, settings: ServerArgs, served_model_name: str) -> FastAPI:
    loras = LoRAModels(engine, served_model_name) if engine.info.max_loras else None
    lora_modules = parse_lora_modules(settings.lora_modules) if loras is not None else []
    spans = _request_spans(engine, settings, served_model_name)
    app = FastAPI(title="pagedserve", version=__version__, root_path=settings.root_path or "",
                  lifespan=_lifespan(loras, lora_modules, spans))
    metrics = Metrics(served_model_name, engine.info.max_model_len, engine.num_engines, engine.info.max_loras)
    engine.finished_hooks.append(metrics.observe_finished)
    engine.inter_token_hooks.append(metrics.observe_inter_token)
    engine.step_hooks.append(metrics.observe_step)
    admission = Admission(engine, settings.max_concurrent_requests, metrics)
    serving = OpenAIServing(engine, served_model_name, admission,
                            settings.tool_call_parser if settings.enable_auto_tool_choice else None, loras,
                            prompt_tokens_details=settings.enable_prompt_tokens_details)
    app.state.engine, app.state.metrics, app.state.admission = engine, metrics, admission
    app.state.drain = drain = Drain(settings.shutdown_timeout)
    dp = engine.client
    scaler = ElasticScaler(dp) if isinstance(dp, DataParallelClient) and dp.start is not None else None
    if spans is not None:         # innermost: it sees only requests the guards let through
        app.add_middleware(TraceHeadersMiddleware)
    _add_guards_and_handlers(app, settings, drain)
    if loras is not None:
        add_lora_routes(app, loras, settings.allow_runtime_lora_updating)
    add_responses_routes(app, serving, settings)
    add_anthropic_routes(app, serving)
    add_pooling_routes(app, engine, served_model_name, admission, serving.check_model)
    add_dev_routes(app, engine)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.completions(body, request)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatCompletionRequest, request: Request) -> Response:
        return await serving.chat(body, request)

    @app.get("/v1/models")
    async def models() -> dict:
        info = engine.info
        cards = [ModelCard(id=served_model_name, root=info.model_path, max_model_len=info.max_model_len)]
        cards += [ModelCard(id=name, root=root, parent=parent, max_model_len=info.max_model_len)
                  for name, root, parent in (loras.cards() if loras is not None else [])]
        return ModelList(data=cards).model_dump()

    @app.get("/health")
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:
            return error_response(503, f"engine unhealthy: {exc}", "service_unavailable")
        if engine.num_engines > 1 or scaler is not None:   # data parallelism: each engine core's state
            states = engine.engine_states()
            status = "ok" if all(e["state"] == "ok" for e in states) else "degraded"
            return JSONResponse({"status": status, "engines": states})
        return Response(status_code=200)

    @app.get("/metrics")
    async def prometheus() -> Response:
        for index, stats in engine.engine_stats.items():
            metrics.observe_stats(stats, index)
        return Response(metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    if envs.VLLM_SERVER_DEV_MODE or settings.api_key:      # with a key, ApiKeyMiddleware guards them
        @app.post("/drain")
        async def drain_route() -> Response:
            drain.begin("POST /drain")
            return JSONResponse({"status": "draining", "in_flight": drain.in_flight}, status_code=202)

        add_elastic_routes(app, engine, scaler, metrics)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        serving.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise RequestError.at("prompt", "give exactly one of prompt or messages")
        if body.messages is not None:
            chat = ChatCompletionRequest(messages=body.messages, tools=body.tools)
            messages = chat.text_messages(images=engine.is_multimodal)
            prompt = await engine.render_chat(messages, body.add_generation_prompt,
                                              continue_final_message=body.continue_final_message,
                                              tools=chat.template_tools())
        else:
            prompt = await engine.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        tokens = prompt.prompt_token_ids
        return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": engine.info.max_model_len})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        serving.check_model(body.model)
        vocab = engine.info.vocab_size
        if any(not 0 <= t < vocab for t in body.tokens):
            raise RequestError("tokens", f"tokens must be in [0, {vocab})")
        return JSONResponse({"prompt": await engine.detokenize(body.tokens)})

    return app


def _add_guards_and_handlers(app: FastAPI, settings: ServerArgs, drain: Drain) -> None:
    # The last added runs first: the key is checked before any of the body is read, and a request refused
    # for either never counts as in flight for the drain.
    app.add_middleware(DrainMiddleware, drain=drain)
    app.add_middleware(BodyLimitMiddleware, max_bytes=settings.max_body_bytes)
    if settings.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=settings.api_key, open_paths=OPEN_PATHS)
    # Outermost: a browser's preflight carries no API key, and a 401 or 413 needs CORS headers to be readable.
    app.add_middleware(CORSMiddleware, allow_origins=list(settings.allowed_origins),
                       allow_methods=list(settings.allowed_methods), allow_headers=list(settings.allowed_headers),
                       allow_credentials=settings.allow_credentials)

    @app.exception_handler(RequestValidationError)
    async def on_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"{loc}: {first.get('msg', 'invalid request')}" if loc else first.get("msg", "invalid request")
        # A model-level check (an unknown field) has no location of its own: the field is in its context.
        param = loc or (first.get("ctx") or {}).get("field")
        return error_response(400, message, "invalid_request_error", param)

    @app.exception_handler(StarletteHTTPException)
    async def on_http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        # Routing and body-parsing errors (404, 405, undecodable body) get OpenAI's error shape too.
        kind = "NotFoundError" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind)

    async def expected(_: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)

    # Registered per class, so these expected errors are answered without the traceback that Starlette's
    # catch-all Exception handler logs (and re-raises).
    for cls in (ValueError, ModelNotFoundError, EngineDeadError):
        app.add_exception_handler(cls, expected)

    @app.exception_handler(Exception)
    async def on_error(_: Request, exc: Exception) -> JSONResponse:
        return response_for(exc)
