"""Prometheus metrics under vLLM's own names (`vllm:` prefix, `model_name` and `engine` labels), so vLLM's
Grafana dashboard and autoscaling rules work unchanged; metrics vLLM has no name for are `pagedserve:`.

Everything is observed in the API process from what the engine core already sends: its per-step
SchedulerStats (gauges, prefix cache, preemptions), each step's outputs (inter-token intervals) and each
finished RequestOutput (counts and per-request latencies; the queue time is measured by the core).
"""
from __future__ import annotations

from types import SimpleNamespace

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.ipc.messages import KVTransferStats, SchedulerStats

# vLLM's buckets, so that its dashboard's quantiles read the same.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
_TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                  20.0, 40.0, 80.0)
_REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                    240.0, 480.0, 960.0, 1920.0, 7680.0)


def count_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value: vLLM's buckets for token counts."""
    buckets, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return buckets
            buckets.append(m * scale)
        scale *= 10


class Metrics:
    """Every metric carries vLLM's `engine` label: the index of the engine core (data-parallel engines 0, 1,
    ...) whose step or request it observes."""

    def __init__(self, model_name: str, max_model_len: int = 2048, num_engines: int = 1, max_loras: int = 0) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model_name
        labels = ["model_name", "engine"]
        self._families: dict[str, Gauge | Counter | Histogram] = {}

        def add(kind: type, attr: str, name: str, doc: str, **kw: object) -> None:
            self._families[attr] = kind(name, doc, labels, registry=r, **kw)
        for attr, name, doc in _GAUGES:
            add(Gauge, attr, name, doc)
        for attr, name, doc in _COUNTERS:
            add(Counter, attr, name, doc)
        counts = count_buckets(max_model_len)
        for attr, name, doc, buckets in _histograms(counts):
            add(Histogram, attr, name, doc, buckets=buckets)
        self.success = Counter("vllm:request_success", "Count of successfully processed requests.",
                               labels + ["finished_reason"], registry=r)
        self.spec_accepted_per_pos = Counter(
            "vllm:spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            labels + ["position"], registry=r)
        # pagedserve's own: vLLM has no admission bounds, so no name for their refusals.
        self.rejected = Counter("pagedserve:request_rejected", "Requests refused with HTTP 429 (reason: "
                                "concurrency = this server's in-flight bound, queue = the engine's waiting "
                                "bound)", ["model_name", "reason"], registry=r)
        # vLLM's LoRA gauge: its labels carry the state (adapter names), its value when that was seen. Only the
        # current label set is kept (vLLM leaves every past one behind).
        self.max_loras = max_loras
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                               registry=r) if max_loras else None
        self._series: dict[int, SimpleNamespace] = {}
        self._last_totals: dict[tuple[int, str], int] = {}
        self._last_per_pos: dict[int, list[int]] = {}
        self._kv_transfer: KVTransferMetrics | None = None     # made at the first stats of a KV connector
        for engine in range(num_engines):      # every engine's series exist (at zero) before any traffic
            self.at(engine)

    def at(self, engine: int) -> SimpleNamespace:
        """Engine `engine`'s series, by attribute (running, ttft, ...)."""
        if engine not in self._series:
            self._series[engine] = SimpleNamespace(**{attr: family.labels(self.model, str(engine))
                                                      for attr, family in self._families.items()})
        return self._series[engine]

    def observe_stats(self, stats: SchedulerStats | None, engine: int = 0) -> None:
        if stats is None:
            return
        m = self.at(engine)
        if self.lora_info is not None:
            self.lora_info.clear()
            self.lora_info.labels(str(self.max_loras), ",".join(stats.waiting_lora_adapters),
                                  ",".join(stats.running_lora_adapters)).set_to_current_time()
        m.running.set(stats.num_running)
        m.waiting.set(stats.num_waiting)
        m.kv_usage.set(stats.kv_cache_usage)
        m.gpu_kv_usage.set(stats.kv_cache_usage)
        # The core reports running totals; counters advance by the difference.
        for attr, field in (("prefix_queries", "prefix_cache_queries"), ("prefix_hits", "prefix_cache_hits"),
                            ("preemptions", "num_preemptions"), ("spec_drafts", "spec_num_drafts"),
                            ("spec_draft_tokens", "spec_num_draft_tokens"),
                            ("spec_accepted", "spec_num_accepted_tokens"),
                            ("external_queries", "external_prefix_cache_queries"),
                            ("external_hits", "external_prefix_cache_hits")):
            total = getattr(stats, field)
            getattr(m, attr).inc(max(0, total - self._last_totals.get((engine, field), 0)))
            self._last_totals[(engine, field)] = total
        last_per_pos = self._last_per_pos.get(engine, [])
        for pos, total in enumerate(stats.spec_accepted_per_pos):
            last = last_per_pos[pos] if pos < len(last_per_pos) else 0
            self.spec_accepted_per_pos.labels(self.model, str(engine), str(pos)).inc(max(0, total - last))
        self._last_per_pos[engine] = list(stats.spec_accepted_per_pos)
        if stats.kv_connector_stats is not None:
            if self._kv_transfer is None:
                self._kv_transfer = KVTransferMetrics(self.registry, self.model)
            self._kv_transfer.observe(stats.kv_connector_stats, engine)

    def observe_step(self, stats: SchedulerStats, engine: int = 0) -> None:
        if stats.num_step_tokens > 0:
            self.at(engine).iteration_tokens.observe(stats.num_step_tokens)

    def observe_inter_token(self, intervals: list[float], engine: int = 0) -> None:
        """One observation per interval between two consecutive output tokens of a sequence."""
        m = self.at(engine)
        for dt in intervals:
            m.itl.observe(dt)
            m.tpot.observe(dt)

    def observe_finished(self, out: RequestOutput, num_output_tokens: int, engine: int = 0) -> None:
        m = self.at(engine)
        m.prompt_tokens.inc(len(out.prompt_token_ids))
        m.generation_tokens.inc(num_output_tokens)
        m.req_prompt_tokens.observe(len(out.prompt_token_ids))
        m.req_generation_tokens.observe(num_output_tokens)
        for c in out.outputs:
            self.success.labels(self.model, str(engine), c.finish_reason or "unknown").inc()
        _observe_latencies(m, out.metrics, num_output_tokens)

    def render(self) -> bytes:
        return generate_latest(self.registry)


# The kv_transfer section: a KV connector's tier (docs/kv_tiers.md), under vLLM's OffloadingConnector names
# where it has them (its transfer_type label, e.g. GPU_to_CPU: here CPU_to_DISK and DISK_to_CPU), and after its
# CPU tier's block lookup counters for the disk tier's. Only servers with a connector export it.
_KV_TRANSFER_COUNTERS = (
    ("block_lookups", "vllm:kv_offload_disk_block_lookup", "Blocks looked up in the disk tier after the prefix "
     "cache (a prompt's chain, up to its first miss)."),
    ("block_hits", "vllm:kv_offload_disk_block_hit", "Disk tier lookups that found the block."),
    ("block_misses", "vllm:kv_offload_disk_block_miss", "Disk tier lookups that did not find the block."),
    ("invalid_blocks", "pagedserve:kv_offload_disk_block_invalid", "Blocks found at lookup whose file was "
     "missing, damaged or foreign at load (deleted; their tokens were computed)."),
    ("stores_skipped", "vllm:kv_offload_stores_skipped", "Blocks not stored: the writer was behind, or an I/O "
     "error stopped saving."),
    ("evictions", "vllm:kv_offload_block_eviction", "Blocks the tier deleted to stay within its size."),
    ("swapped_in_tokens", "pagedserve:kv_offload_swapped_in_tokens", "Tokens of preempted requests loaded back "
     "from the tier when they resumed, instead of recomputed."),
)
# (stats field, direction): bytes and seconds per transfer direction.
_KV_TRANSFERS = (("store", "{device}_to_DISK"), ("load", "DISK_to_{device}"))


class KVTransferMetrics:
    """The kv_transfer section's families; the core sends totals since start, counters advance by the change."""

    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        labels = ["model_name", "engine"]
        self.counters = {field: Counter(name, doc, labels, registry=registry)
                         for field, name, doc in _KV_TRANSFER_COUNTERS}
        self.bytes = Counter("vllm:kv_offload_total_bytes", "Bytes moved between the KV pool and the tier, by "
                             "transfer_type.", [*labels, "transfer_type"], registry=registry)
        self.seconds = Counter("vllm:kv_offload_total_time", "Seconds spent moving KV between the pool and the "
                               "tier (reads and checks, or writes), by transfer_type.", [*labels, "transfer_type"],
                               registry=registry)
        self._last: dict[tuple[int, str], float] = {}

    def _advance(self, counter: Counter, value: float, engine: int, key: str, *labels: str) -> None:
        last = self._last.get((engine, key), 0)
        counter.labels(self.model, str(engine), *labels).inc(max(0, value - last))
        self._last[(engine, key)] = value

    def observe(self, st: KVTransferStats, engine: int) -> None:
        for field, counter in self.counters.items():
            self._advance(counter, getattr(st, field), engine, field)
        for kind, direction in _KV_TRANSFERS:
            label = direction.format(device=st.device)
            self._advance(self.bytes, getattr(st, f"{kind}_bytes"), engine, f"{kind}_bytes", label)
            self._advance(self.seconds, getattr(st, f"{kind}_time_s"), engine, f"{kind}_time_s", label)


def _observe_latencies(m: SimpleNamespace, t: dict[str, float], num_output_tokens: int) -> None:
    arrival, first, last = t.get("arrival_time"), t.get("first_token_time"), t.get("last_token_time")
    queue = t.get("queue_time")
    if arrival is not None and last is not None:
        m.e2e.observe(max(0.0, last - arrival))
    if queue is not None:
        m.queue.observe(queue)
    if arrival is None or first is None:
        return
    ttft = max(0.0, first - arrival)
    m.ttft.observe(ttft)
    if queue is not None:
        # The phases from durations, not from the core's clock: the core may run on another host.
        prefill = max(0.0, ttft - queue)
        m.prefill.observe(prefill)
        if last is not None:
            m.inference.observe(prefill + max(0.0, last - first))
    if last is not None:
        m.decode.observe(max(0.0, last - first))
        if num_output_tokens > 1:
            m.req_tpot.observe(max(0.0, (last - first) / (num_output_tokens - 1)))


_GAUGES = (
    ("running", "vllm:num_requests_running", "Number of requests in model execution batches."),
    ("waiting", "vllm:num_requests_waiting", "Number of requests waiting to be processed."),
    ("kv_usage", "vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage."),
    # vLLM's name before 0.9; older dashboards and autoscaling rules still read it.
    ("gpu_kv_usage", "vllm:gpu_cache_usage_perc", "KV-cache usage (1 = full); the same value as "
     "vllm:kv_cache_usage_perc, under vLLM's older name."),
)
_COUNTERS = (
    ("prefix_queries", "vllm:prefix_cache_queries", "Prefix cache queries, in queried tokens."),
    ("prefix_hits", "vllm:prefix_cache_hits", "Prefix cache hits, in cached tokens."),
    ("preemptions", "vllm:num_preemptions", "Cumulative number of preemptions in the engine."),
    # A KV connector's tier after the prefix cache (vLLM's names; docs/kv_tiers.md).
    ("external_queries", "vllm:external_prefix_cache_queries", "External prefix cache queries, in queried tokens."),
    ("external_hits", "vllm:external_prefix_cache_hits", "External prefix cache hits, in cached tokens."),
    ("prompt_tokens", "vllm:prompt_tokens", "Number of prefill tokens processed."),
    ("generation_tokens", "vllm:generation_tokens", "Number of generation tokens processed."),
    # Speculative decoding (vLLM's names): verify passes with drafts, draft tokens, accepted ones.
    ("spec_drafts", "vllm:spec_decode_num_drafts", "Number of spec decoding drafts."),
    ("spec_draft_tokens", "vllm:spec_decode_num_draft_tokens", "Number of draft tokens."),
    ("spec_accepted", "vllm:spec_decode_num_accepted_tokens", "Number of accepted tokens."),
)


def _histograms(counts: list[int]) -> tuple[tuple[str, str, str, tuple | list], ...]:
    return (
        ("req_prompt_tokens", "vllm:request_prompt_tokens", "Prompt tokens per request.", counts),
        ("req_generation_tokens", "vllm:request_generation_tokens", "Generated tokens per request.", counts),
        ("ttft", "vllm:time_to_first_token_seconds", "Time to first token in seconds.", _TTFT_BUCKETS),
        ("itl", "vllm:inter_token_latency_seconds", "Time between consecutive output tokens.", _TOKEN_BUCKETS),
        # The same intervals under vLLM's older name, which its Grafana dashboard plots.
        ("tpot", "vllm:time_per_output_token_seconds", "Time between consecutive output tokens (vLLM's older "
         "name of vllm:inter_token_latency_seconds).", _TOKEN_BUCKETS),
        ("req_tpot", "vllm:request_time_per_output_token_seconds",
         "Mean time per output token of each request after its first.", _TOKEN_BUCKETS),
        ("e2e", "vllm:e2e_request_latency_seconds", "Arrival to last token, per request.", _REQUEST_BUCKETS),
        ("queue", "vllm:request_queue_time_seconds", "Time a request waited before the engine first scheduled it.",
         _REQUEST_BUCKETS),
        ("prefill", "vllm:request_prefill_time_seconds", "First scheduling to first token.", _REQUEST_BUCKETS),
        ("decode", "vllm:request_decode_time_seconds", "First token to last token.", _REQUEST_BUCKETS),
        ("inference", "vllm:request_inference_time_seconds", "First scheduling to last token.", _REQUEST_BUCKETS),
        ("iteration_tokens", "vllm:iteration_tokens_total", "Tokens per engine step.",
         (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)),
    )
