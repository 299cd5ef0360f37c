"""Elastic data parallelism: grow or shrink engine-serve's data-parallel engines at run time without dropping a
request (`--enable-elastic-ep`; the routes are frontend/dp/elastic_routes.py).

Growing starts new engine cores, each serving as soon as it is up. Shrinking takes the highest-ranked engines
out of routing at once (they get no new request), waits until the requests they hold have finished, then stops
them; requests never move between engines, so nothing is cut. When they do not drain within the timeout the
scale is called off: they route again, and the caller hears TimeoutError. One scale runs at a time.

vLLM's /scale_elastic_ep refuses every request while it scales (it must rebuild the expert-parallel groups); here
engines share nothing, so the others serve throughout.
"""
from __future__ import annotations

import asyncio
import logging

from pagedserve.frontend.dp.client import DataParallelClient

logger = logging.getLogger(__name__)


class ScalingInProgressError(RuntimeError):
    """Another scale is running."""


class ElasticScaler:
    def __init__(self, client: DataParallelClient) -> None:
        self.client = client
        self.scaling = False

    @property
    def size(self) -> int:
        return self.client.num_engines

    async def scale(self, new_size: int, drain_timeout_s: float) -> None:
        """Make it `new_size` engines (>= 1). ScalingInProgressError while another scale runs; TimeoutError when
        the engines to stop still hold requests after drain_timeout_s; the core's error if a new one cannot
        start (the engines started before it stay)."""
        if new_size < 1:
            raise ValueError(f"new_data_parallel_size must be >= 1, got {new_size}")
        if self.scaling:
            raise ScalingInProgressError("a scale is already in progress: wait for POST /is_scaling_elastic_ep "
                                         "to answer false")
        self.scaling = True
        try:
            logger.info("scaling data-parallel engines from %d to %d", self.size, new_size)
            while self.size < new_size:
                await self.client.add_engine()
            if self.size > new_size:
                await self._shrink(new_size, drain_timeout_s)
        finally:
            self.scaling = False

    async def _shrink(self, new_size: int, drain_timeout_s: float) -> None:
        client = self.client
        leaving = set(range(new_size, self.size))
        client.draining |= leaving
        for engine in leaving:
            client.router.set_available(engine, False)
        try:
            await asyncio.wait_for(self._drained(leaving), drain_timeout_s)
        except asyncio.TimeoutError:
            held = client.requests_on(leaving)
            client.draining -= leaving
            for engine in leaving:
                if engine not in client.down:          # a dead one is the restart logic's (and it stays out)
                    client.router.set_available(engine, True)
            raise TimeoutError(f"engines {sorted(leaving)} still had {held} requests after the drain timeout "
                               f"({drain_timeout_s:g} s); they serve on, the size stays {self.size}") from None
        await client.retire_engines(new_size)

    async def _drained(self, engines: set[int]) -> None:
        while self.client.requests_on(engines):
            await self.client.wait_drain_progress()
