"""Prometheus metrics with vLLM's names under a `pagedserve:` prefix, on a registry owned by the app."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedserve.frontend.outputs import RequestOutput
from pagedserve.ipc.messages import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
_TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0)


class Metrics:
    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        r, p = self.registry, "pagedserve:"
        self.running = Gauge(f"{p}num_requests_running", "Requests in the running batch", labels, registry=r)
        self.waiting = Gauge(f"{p}num_requests_waiting", "Requests waiting to be scheduled", labels, registry=r)
        self.kv_usage = Gauge(f"{p}kv_cache_usage_perc", "KV cache usage (1 = full)", labels, registry=r)
        self.prefix_queries = Counter(f"{p}prefix_cache_queries", "Prompt tokens looked up in the prefix cache",
                                      labels, registry=r)
        self.prefix_hits = Counter(f"{p}prefix_cache_hits", "Prompt tokens found in the prefix cache", labels,
                                   registry=r)
        self.preemptions = Counter(f"{p}num_preemptions", "Preempted requests", labels, registry=r)
        self.prompt_tokens = Counter(f"{p}prompt_tokens", "Prompt tokens processed", labels, registry=r)
        self.generation_tokens = Counter(f"{p}generation_tokens", "Tokens generated", labels, registry=r)
        self.rejected = Counter(f"{p}request_rejected", "Requests refused with HTTP 429 (reason: concurrency "
                                "= this server's in-flight bound, queue = the engine's waiting bound)",
                                labels + ["reason"], registry=r)
        self.success = Counter(f"{p}request_success", "Finished requests", labels + ["finished_reason"],
                               registry=r)
        self.ttft = Histogram(f"{p}time_to_first_token_seconds", "Time to first token", labels,
                              buckets=_LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{p}inter_token_latency_seconds", "Time between output tokens", labels,
                             buckets=_TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram(f"{p}e2e_request_latency_seconds", "Arrival to last token", labels,
                             buckets=_LATENCY_BUCKETS, registry=r)
        self.queue = Histogram(f"{p}request_queue_time_seconds", "Arrival to first scheduling", labels,
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.model = model_name
        self._last_prefix = (0, 0, 0)

    def observe_stats(self, stats: SchedulerStats | None) -> None:
        if stats is None:
            return
        m = self.model
        self.running.labels(m).set(stats.num_running)
        self.waiting.labels(m).set(stats.num_waiting)
        self.kv_usage.labels(m).set(stats.kv_cache_usage)
        # The core reports running totals; counters advance by the difference.
        q, h, pre = self._last_prefix
        self.prefix_queries.labels(m).inc(max(0, stats.prefix_cache_queries - q))
        self.prefix_hits.labels(m).inc(max(0, stats.prefix_cache_hits - h))
        self.preemptions.labels(m).inc(max(0, stats.num_preemptions - pre))
        self._last_prefix = (stats.prefix_cache_queries, stats.prefix_cache_hits, stats.num_preemptions)

    def observe_finished(self, out: RequestOutput, num_output_tokens: int) -> None:
        m = self.model
        self.prompt_tokens.labels(m).inc(len(out.prompt_token_ids))
        self.generation_tokens.labels(m).inc(num_output_tokens)
        for c in out.outputs:
            self.success.labels(m, c.finish_reason or "unknown").inc()
        t = out.metrics
        arrival, first, last = t.get("arrival_time"), t.get("first_token_time"), t.get("last_token_time")
        if arrival is not None and last is not None:
            self.e2e.labels(m).observe(max(0.0, last - arrival))
        if arrival is not None and first is not None:
            self.ttft.labels(m).observe(max(0.0, first - arrival))
            if num_output_tokens > 1 and last is not None:
                self.itl.labels(m).observe(max(0.0, (last - first) / (num_output_tokens - 1)))
        if "queue_time" in t:
            self.queue.labels(m).observe(t["queue_time"])

    def render(self) -> bytes:
        return generate_latest(self.registry)
