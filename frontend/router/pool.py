"""The replicas behind the router and what the probes know of them.

Every --health-check-interval each replica's /health, /v1/models and /metrics are read (concurrently, each
probe bounded by the interval): healthy means /health answered 200, so a dead replica and a draining one
(503, frontend/http/drain.py) leave the pool at the next probe, and come back at the first probe that passes.
A request that finds a replica refusing connections takes it out at once (`mark_down`), without waiting.

The set of replicas itself may change (`sync`, from frontend/router/k8s.py's watch): a new one joins once its
first probe passes, probed at once rather than at the next interval; a gone one leaves at once (requests open
on it finish, nothing new goes to it).
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field

import httpx
from prometheus_client.parser import text_string_to_metric_families

logger = logging.getLogger(__name__)

PROBE_TIMEOUT_FLOOR_S = 2.0
RUNNING, WAITING = "vllm:num_requests_running", "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
# The least free KV fraction a score divides by: a full cache scores as a hundredfold load, not infinity, so
# that among replicas all full the queues still decide.
KV_FREE_FLOOR = 0.01


@dataclass
class Replica:
    index: int
    url: str
    api_key: str | None
    healthy: bool = False
    models: list[dict] = field(default_factory=list)    # its /v1/models cards, as it last listed them
    running: float = 0.0                                 # its own gauges, summed over engines, last scraped
    waiting: float = 0.0
    kv_usage: float = 0.0                                # its fullest engine's vllm:kv_cache_usage_perc (0..1)
    in_flight: int = 0                                   # requests this router has open on it now
    removed: bool = False                                # left the pool's list (discovery no longer lists it)
    # Whether its cache outlives its absence from the pool: the process was there throughout (it only timed out,
    # or answered unhealthy: a CPU replica deep in a long prefill answers /health late, or 503 when its engine
    # core's ping takes over 5 s), never refused or reset a connection, so it did not restart. Prefix routing
    # then keeps its record of what the replica holds.
    cache_kept: bool = False

    @property
    def load(self) -> float:
        # The scrape lags; what this router has open on it is a floor it knows now.
        return max(self.running + self.waiting, float(self.in_flight))

    @property
    def score(self) -> float:
        """least-load's cost of one more request here, lowest first: its queue, stretched by how full its KV
        cache is. A replica's free KV bounds what it can run at once; a nearly full one queues or preempts a new
        request however short its queue looks (the queue gauges count neither the blocks held nor the
        preemptions to come)."""
        return (self.load + 1.0) / max(1.0 - self.kv_usage, KV_FREE_FLOOR)

    def serves(self, model: str | None) -> bool:
        return model is None or any(card.get("id") == model for card in self.models)

    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}


class ReplicaPool:
    def __init__(self, replicas: list[Replica], interval_s: float, client: httpx.AsyncClient,
                 on_change: Callable[[Replica], None], key_for: Callable[[int], str | None]) -> None:
        self.replicas = replicas
        self.interval_s = interval_s
        self.client = client
        self.on_change = on_change          # called when a replica joins or leaves the pool
        self.key_for = key_for              # the API key towards replica `index`
        self._next_index = len(replicas)    # indices are never reused: routing state is keyed by them
        self._first_probes: set[asyncio.Task] = set()

    def sync(self, urls: Collection[str]) -> None:
        """Make the replicas exactly `urls` (in the event loop's thread)."""
        wanted = {url.rstrip("/") for url in urls}
        for replica in [r for r in self.replicas if r.url not in wanted]:
            logger.info("replica %s is no longer discovered", replica.url)
            self.replicas.remove(replica)
            replica.removed = True
            self.mark_down(replica, "no longer discovered")
        for url in sorted(wanted - {r.url for r in self.replicas}):
            replica = Replica(self._next_index, url, self.key_for(self._next_index))
            self._next_index += 1
            self.replicas.append(replica)
            logger.info("replica %s discovered; it joins once its probe passes", url)
            task = asyncio.get_running_loop().create_task(self._probe(replica))
            self._first_probes.add(task)
            task.add_done_callback(self._first_probes.discard)

    def candidates(self, model: str | None) -> list[Replica]:
        return [r for r in self.replicas if r.healthy and r.serves(model)]

    def known(self, model: str | None) -> bool:
        """Whether any replica, healthy or not, has listed this model."""
        return any(r.serves(model) for r in self.replicas)

    def models(self) -> list[dict]:
        """The union of the healthy replicas' model cards, first listing wins."""
        cards: dict[str, dict] = {}
        for replica in self.replicas:
            if replica.healthy:
                for card in replica.models:
                    cards.setdefault(card.get("id"), card)
        return list(cards.values())

    def mark_down(self, replica: Replica, reason: str, alive: bool = False) -> None:
        """alive: it timed out or answered, so the process was there (see Replica.cache_kept); every failure of
        one absence must be, for its cache to count as kept."""
        replica.cache_kept = alive if replica.healthy else replica.cache_kept and alive
        if replica.healthy:
            logger.warning("replica %s leaves the pool: %s", replica.url, reason)
            replica.healthy = False
            self.on_change(replica)

    async def run(self) -> None:
        """Probe forever (the app's lifespan cancels it)."""
        while True:
            await asyncio.sleep(self.interval_s)
            await self.probe_all()

    async def probe_all(self) -> None:
        await asyncio.gather(*(self._probe(r) for r in list(self.replicas)))

    async def _probe(self, replica: Replica) -> None:
        # A busy replica's /health may take a while on a loaded CPU; a short interval must not make it dead.
        timeout = max(PROBE_TIMEOUT_FLOOR_S, self.interval_s)
        try:
            health = await self.client.get(f"{replica.url}/health", headers=replica.headers(), timeout=timeout)
            healthy = health.status_code == 200
            if healthy:
                models = await self.client.get(f"{replica.url}/v1/models", headers=replica.headers(),
                                               timeout=timeout)
                models.raise_for_status()
                replica.models = list(models.json().get("data", []))
                await self._scrape(replica, timeout)
            reason, alive = f"/health answered {health.status_code}", True
        except (httpx.HTTPError, ValueError) as exc:     # unreachable, or answers that are not what they say
            healthy, reason = False, f"{type(exc).__name__}: {exc}"
            alive = isinstance(exc, httpx.TimeoutException)
        if replica.removed:           # discovery dropped it while the probe was out
            return
        if healthy and not replica.healthy:
            logger.info("replica %s joins the pool (%d models)", replica.url, len(replica.models))
            replica.healthy = True
            self.on_change(replica)
        elif not healthy:
            self.mark_down(replica, reason, alive)

    async def _scrape(self, replica: Replica, timeout: float) -> None:
        """Its queue gauges and KV usage; a replica without them (not a vLLM-shaped server) counts as idle."""
        r = await self.client.get(f"{replica.url}/metrics", headers=replica.headers(), timeout=timeout)
        if r.status_code != 200:
            return
        values = {RUNNING: 0.0, WAITING: 0.0, KV_USAGE: 0.0}
        try:
            for family in text_string_to_metric_families(r.text):
                if family.name in values and family.samples:
                    # Queues add up over a replica's data-parallel engines; KV usage is its fullest engine's
                    # (as the replica's own summary, AsyncEngineClient.last_stats).
                    merge = max if family.name == KV_USAGE else sum
                    values[family.name] = merge(s.value for s in family.samples)
        except ValueError:          # not Prometheus text: the replica has no load to read
            return
        replica.running, replica.waiting = values[RUNNING], values[WAITING]
        replica.kv_usage = min(1.0, max(0.0, values[KV_USAGE]))
