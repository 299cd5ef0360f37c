"""`pagedserve router`'s ASGI app: its own /health, /metrics, /version and /v1/models (the union of the
replicas'), and every other route forwarded to a replica (frontend/router/proxy.py)."""
from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagedserve.common.version import __version__
from pagedserve.frontend.http.guards import ApiKeyMiddleware, BodyLimitMiddleware
from pagedserve.frontend.router.args import RouterArgs
from pagedserve.frontend.router.dynamic_config import DynamicConfigFile
from pagedserve.frontend.router.k8s import K8sDiscovery
from pagedserve.frontend.router.lora import LoraPlacer, parse_lora_modules
from pagedserve.frontend.router.metrics import RouterMetrics
from pagedserve.frontend.router.pool import Replica, ReplicaPool
from pagedserve.frontend.router.proxy import Proxy
from pagedserve.frontend.router.routing import Routing, request_facts

logger = logging.getLogger(__name__)

OPEN_PATHS = frozenset({"/health", "/metrics", "/version"})
FORWARDED_METHODS = ["GET", "POST", "PUT", "DELETE", "PATCH"]


def build_router_app(args: RouterArgs) -> FastAPI:
    replicas = [Replica(i, url.rstrip("/"), args.key_for(i)) for i, url in enumerate(args.backend)]
    routing = Routing(args.routing_logic, len(replicas), args.prefix_block_chars)
    metrics = RouterMetrics()
    # One connection pool for every replica; no bound on connections: admission is the replicas' (their 429s).
    client = httpx.AsyncClient(timeout=httpx.Timeout(args.request_timeout, connect=min(5.0, args.request_timeout)),
                               limits=httpx.Limits(max_connections=None, max_keepalive_connections=512))
    pool = ReplicaPool(replicas, args.health_check_interval, client, routing.replica_changed, args.key_for)
    lora = LoraPlacer(pool, client, parse_lora_modules(args.lora_modules)) if args.routing_logic == "lora" else None
    proxy = Proxy(pool, routing, metrics, client, args.max_retries,
                  pass_client_auth=not args.api_key and not args.backend_api_key, lora=lora)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        config_file = None
        if args.dynamic_config_json is not None:       # a missing or bad file stops the start here
            config_file = DynamicConfigFile(args.dynamic_config_json, args.routing_logic, pool.sync)
            config_file.load()
        discovery = _start_discovery(args, pool)
        tasks = [asyncio.create_task(pool.run())]
        if config_file is not None:
            tasks.append(asyncio.create_task(config_file.run()))
        await pool.probe_all()         # the first requests find the pool known
        logger.info("router over %d replicas (%d healthy), routing-logic %s, service-discovery %s",
                    len(pool.replicas), len(pool.candidates(None)), args.routing_logic, args.service_discovery)
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            if discovery is not None:
                discovery.stop()
            await client.aclose()

    app = FastAPI(title="pagedserve router", version=__version__, lifespan=lifespan, openapi_url=None)
    app.state.pool, app.state.metrics = pool, metrics
    app.add_middleware(BodyLimitMiddleware, max_bytes=args.max_body_bytes)
    if args.api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=args.api_key, open_paths=OPEN_PATHS)

    @app.get("/health")
    async def health() -> Response:
        up = len(pool.candidates(None))
        return JSONResponse({"status": "ok" if up else "unavailable", "healthy_replicas": up,
                             "replicas": len(pool.replicas)}, status_code=200 if up else 503)

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(pool), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": pool.models()}

    @app.api_route("/{path:path}", methods=FORWARDED_METHODS)
    async def forward(request: Request) -> Response:
        body = await request.body()
        facts = request_facts(body, dict(request.headers), args.session_key)
        return await proxy.forward(request, body, facts)

    return app


def _start_discovery(args: RouterArgs, pool: ReplicaPool) -> K8sDiscovery | None:
    """The watch that keeps the pool's replicas in step with Kubernetes, if the replicas come from there."""
    if args.service_discovery != "k8s":
        return None
    discovery = K8sDiscovery(args.k8s_namespace, args.k8s_label_selector, args.k8s_port, pool.sync,
                             asyncio.get_running_loop())
    discovery.start()
    return discovery
