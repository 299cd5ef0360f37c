"""vLLM's development routes for RL trainers (verl, TRL, OpenRLHF drive a server with them): /sleep, /wake_up,
/is_sleeping, /reset_prefix_cache, /collective_rpc. They exist only with VLLM_SERVER_DEV_MODE=1, as in vLLM,
and sit behind --api-key like every route. Each is one utility call to the engine core (core/rl/control.py).
"""
from __future__ import annotations

import math
from typing import Any

from fastapi import FastAPI, Query
from fastapi.responses import Response
from pydantic import BaseModel, Field

from pagedserve.common import envs


class CollectiveRpcRequest(BaseModel):
    method: str = Field(min_length=1)
    timeout: float | None = Field(default=None, gt=0)
    args: list[Any] = []
    kwargs: dict[str, Any] = {}


def add_dev_routes(app: FastAPI, engine: Any) -> None:
    """The routes, when VLLM_SERVER_DEV_MODE=1; nothing otherwise."""
    if not envs.VLLM_SERVER_DEV_MODE:
        return

    @app.post("/sleep")
    async def sleep(level: int = Query(1, ge=1, le=2), abort_requests: bool = False) -> Response:
        # Finishing the requests held first may take as long as they do.
        await engine.call_utility("sleep", level, abort_requests, timeout_s=math.inf)
        return Response(status_code=200)

    @app.post("/wake_up")
    async def wake_up(tags: list[str] | None = Query(None)) -> Response:
        await engine.call_utility("wake_up", tags, timeout_s=math.inf)
        return Response(status_code=200)

    @app.get("/is_sleeping")
    async def is_sleeping() -> dict[str, bool]:
        return {"is_sleeping": bool(await engine.call_utility("is_sleeping"))}

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> Response:
        await engine.call_utility("reset_prefix_cache")
        return Response(status_code=200)

    @app.post("/collective_rpc")
    async def collective_rpc(body: CollectiveRpcRequest) -> dict[str, list[Any]]:
        results = await engine.call_utility("collective_rpc", body.method, body.args, body.kwargs,
                                            timeout_s=math.inf if body.timeout is None else body.timeout)
        return {"results": results}
