"""`pagedserve proxy`'s ASGI app: a completion is sent to a prefill instance with max_tokens=1 (its prompt's
KV reaches the shared folder before it answers), then as the client sent it to a decode instance, whose answer
streams back (vLLM's disaggregated-prefill proxy example). Every other route goes to a decode instance."""
from __future__ import annotations

import contextlib
import itertools
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve.common.version import __version__
from pagedserve.frontend.disagg.args import DisaggProxyArgs
from pagedserve.frontend.http.guards import ApiKeyMiddleware, BodyLimitMiddleware

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health"})
TWO_STAGE_PATHS = ("/v1/completions", "/v1/chat/completions")
_DROP_REQUEST = frozenset({"host", "content-length", "connection", "keep-alive", "transfer-encoding",
                           "upgrade", "te"})
_DROP_RESPONSE = frozenset({"content-length", "connection", "keep-alive", "transfer-encoding", "date", "server"})


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request as the prefill instance gets it: one token, one choice, no stream. The prompt (and so its
    blocks' keys) is the client's, so the decode instance looks up exactly what the prefill stored."""
    out = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}
    out["max_tokens"] = 1
    if "max_completion_tokens" in out:
        out["max_completion_tokens"] = 1
    out["n"] = 1
    return out


def build_proxy_app(args: DisaggProxyArgs) -> FastAPI:
    client = httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=min(5.0, args.request_timeout)),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=256))
    prefills = itertools.cycle([u.rstrip("/") for u in args.prefill])
    decodes = itertools.cycle([u.rstrip("/") for u in args.decode])

    def headers_of(request: Request) -> dict[str, str]:
        headers = {k: v for k, v in request.headers.items() if k not in _DROP_REQUEST}
        if args.api_key:                    # the client's key is the proxy's, not the instances'
            headers.pop("authorization", None)
        if args.backend_api_key:
            headers["authorization"] = f"Bearer {args.backend_api_key}"
        return headers

    async def send(url: str, request: Request, content: bytes) -> httpx.Response | JSONResponse:
        upstream = client.build_request(request.method, f"{url}{request.url.path}", params=request.url.query or None,
                                        headers=headers_of(request), content=content)
        try:
            return await client.send(upstream, stream=True)
        except httpx.HTTPError as exc:
            logger.warning("%s failed: %s: %s", url, type(exc).__name__, exc)
            return _error(503, f"an instance ({url}) could not be reached: {type(exc).__name__}",
                          "service_unavailable", None)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        logger.info("disaggregated prefill over %s, decode over %s", ", ".join(args.prefill), ", ".join(args.decode))
        try:
            yield
        finally:
            await client.aclose()

    app = FastAPI(title="pagedserve proxy", version=__version__, lifespan=lifespan, openapi_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_body_bytes)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, open_paths=OPEN_PATHS)

    @app.get("/health")
    async def health() -> Response:
        down = []
        for url in (*args.prefill, *args.decode):
            try:
                ok = (await client.get(f"{url.rstrip('/')}/health", timeout=5.0)).status_code == 200
            except httpx.HTTPError:
                ok = False
            if not ok:
                down.append(url)
        return JSONResponse({"status": "unavailable" if down else "ok", "down": down},
                            status_code=503 if down else 200)

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def two_stage(request: Request) -> Response:
        raw = await request.body()
        try:
            body = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            return _error(400, f"the request body is not JSON: {exc}", "BadRequestError", "body")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object", "BadRequestError", "body")
        first = await send(next(prefills), request, json.dumps(prefill_body(body)).encode())
        if isinstance(first, JSONResponse):
            return first
        if first.status_code >= 400:        # the client's mistake (or the instance's): its own answer, whole
            return await _relay(first)
        await first.aread()
        await first.aclose()
        second = await send(next(decodes), request, raw)
        return second if isinstance(second, JSONResponse) else await _relay(second)

    @app.api_route("/{path:path}", methods=["GET", "POST", "PUT", "DELETE", "PATCH"])
    async def to_decode(request: Request) -> Response:
        upstream = await send(next(decodes), request, await request.body())
        return upstream if isinstance(upstream, JSONResponse) else await _relay(upstream)

    return app


async def _relay(upstream: httpx.Response) -> StreamingResponse:
    headers = {k: v for k, v in upstream.headers.items() if k not in _DROP_RESPONSE}

    async def body() -> AsyncIterator[bytes]:
        try:
            async for chunk in upstream.aiter_raw():
                yield chunk
        finally:
            await upstream.aclose()
    return StreamingResponse(body(), status_code=upstream.status_code, headers=headers)


def _error(status: int, message: str, kind: str, param: str | None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": status}},
                        status_code=status)
