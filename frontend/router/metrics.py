"""The router's own Prometheus metrics (prometheus_client, as the server's), `pagedserve_router:` names:
vLLM's production-stack router has no stable names of its own to match."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from pagedserve.frontend.router.pool import ReplicaPool


class RouterMetrics:
    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.requests = Counter(
            "pagedserve_router:requests", "Requests answered, by the replica that answered (none: the router "
            "itself) and outcome (ok, client_error, server_error, broken = the stream broke mid-way, "
            "overloaded = every replica tried answered 429, unavailable = no replica could take it)",
            ["replica", "outcome"], registry=r)
        self.retries = Counter(
            "pagedserve_router:retries", "Attempts that failed before the first byte and went to another "
            "replica, by the replica that failed and why (connect, reset, timeout, 503, 429)",
            ["replica", "reason"], registry=r)
        self.decisions = Counter(
            "pagedserve_router:routing_decisions", "Routing decisions by logic and decision (prefix-hit / "
            "prefix-miss: the prefix hit estimate; session; session-none; roundrobin; least-load; lora; lora-load = "
            "an adapter was loaded on a replica for the request)",
            ["logic", "decision"], registry=r)
        self.healthy = Gauge("pagedserve_router:replica_healthy", "1 while the replica is in the pool",
                             ["replica"], registry=r)
        self.running = Gauge("pagedserve_router:num_requests_running",
                             "The healthy replicas' vllm:num_requests_running, summed", registry=r)
        # The one series an autoscaler (HPA, KEDA) scales the fleet on.
        self.waiting = Gauge("pagedserve_router:num_requests_waiting",
                             "The healthy replicas' vllm:num_requests_waiting, summed: the fleet's queue depth",
                             registry=r)

    def render(self, pool: ReplicaPool) -> bytes:
        up = [r for r in pool.replicas if r.healthy]
        self.healthy.clear()        # discovered replicas come and go: a gone one's series goes too
        for replica in pool.replicas:
            self.healthy.labels(replica.url).set(1 if replica.healthy else 0)
        self.running.set(sum(r.running for r in up))
        self.waiting.set(sum(r.waiting for r in up))
        return generate_latest(self.registry)
