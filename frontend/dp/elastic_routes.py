"""The HTTP face of elastic data parallelism (frontend/dp/elastic.py), vLLM's routes and body:
POST /scale_elastic_ep (and POST /scale, issue 49's name) with {"new_data_parallel_size": N, "drain_timeout": S},
and POST /is_scaling_elastic_ep. Guarded like /drain: they exist with VLLM_SERVER_DEV_MODE=1 or an --api-key,
behind the key."""
from __future__ import annotations

import json
import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pagedserve.common.errors import RequestError
from pagedserve.frontend.client.async_client import AsyncEngineClient
from pagedserve.frontend.dp.elastic import ElasticScaler, ScalingInProgressError
from pagedserve.frontend.http.errors import error_payload
from pagedserve.frontend.http.metrics import Metrics
from pagedserve.ipc.messages import SchedulerStats

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 120      # vLLM's default for drain_timeout
SCALE_PATHS = ("/scale_elastic_ep", "/scale")


def _error(status: int, message: str, kind: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content=error_payload(status, message, kind, param))


def _positive_int(body: dict[str, Any], field: str, default: int | None) -> int:
    value = body.get(field, default)
    if value is None:
        raise RequestError(field, f"{field} is required")
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise RequestError(field, f"{field} must be a positive integer, got {value!r}")
    return value


def add_elastic_routes(app: FastAPI, engine: AsyncEngineClient, scaler: ElasticScaler | None,
                       metrics: Metrics) -> None:
    """scaler: None when the server was started without --enable-elastic-ep (the routes then say so)."""

    async def scale(request: Request) -> JSONResponse:
        if scaler is None:
            return _error(400, "this server's data-parallel size is fixed: start engine-serve with "
                               "--enable-elastic-ep to scale it", "invalid_request_error")
        try:
            body = json.loads(await request.body() or b"null")
        except ValueError:
            return _error(400, "the body is not JSON", "invalid_request_error")
        if not isinstance(body, dict):
            return _error(400, 'the body must be a JSON object: {"new_data_parallel_size": N}',
                          "invalid_request_error")
        size = _positive_int(body, "new_data_parallel_size", None)         # a RequestError is a 400 naming it
        timeout_s = _positive_int(body, "drain_timeout", DEFAULT_DRAIN_TIMEOUT_S)
        before = scaler.size
        try:
            await scaler.scale(size, timeout_s)
        except ScalingInProgressError as exc:
            return _error(409, str(exc), "conflict_error")
        except TimeoutError as exc:
            return _error(408, f"scale failed: {exc}", "timeout_error")
        except Exception as exc:        # a new core that could not start: the size it reached stands
            logger.error("scale to %d failed: %s", size, exc)
            return _error(500, f"scale failed at {scaler.size} engines: {exc}", "internal_server_error")
        finally:
            _forget_stopped_engines(engine, metrics, scaler.size, before)
        return JSONResponse({"message": f"Scaled to {size} data parallel engines", "data_parallel_size": size})

    for path in SCALE_PATHS:
        app.add_api_route(path, scale, methods=["POST"])

    @app.post("/is_scaling_elastic_ep")
    async def is_scaling() -> JSONResponse:
        return JSONResponse({"is_scaling_elastic_ep": scaler is not None and scaler.scaling,
                             "data_parallel_size": engine.num_engines})


def _forget_stopped_engines(engine: AsyncEngineClient, metrics: Metrics, size: int, before: int) -> None:
    """A stopped engine's last stats would stay in the summaries, and its gauges at their last values: zero
    them (which also restarts its counters' baselines, as a new engine at that index counts from 0)."""
    for index in range(size, before):
        engine.engine_stats.pop(index, None)
        metrics.observe_stats(SchedulerStats(num_running=0, num_waiting=0, kv_cache_usage=0.0,
                                             prefix_cache_queries=0, prefix_cache_hits=0, num_preemptions=0), index)
