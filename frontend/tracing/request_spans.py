"""One span per finished request, named and shaped as vLLM's (`llm_request`, kind SERVER, vLLM's
`gen_ai.*` attribute names), parented to the caller's `traceparent` when it sent one.

The engine client calls `begin` when a request starts (its trace headers and sampling parameters are kept),
`finish` with its last output (the span is made from the output's timings: it starts at the request's
arrival and ends at its last token), and `drop` when it ended unfinished (aborted, disconnected)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.client.input_processor import PreparedRequest
from pagedserve.frontend.client.outputs import RequestOutput
from pagedserve.frontend.tracing import otel
from pagedserve.frontend.tracing.trace_headers import current_trace_headers

SPAN_NAME = "llm_request"


class SpanAttributes:
    """vLLM's names (vllm/tracing.py), from OpenTelemetry's GenAI conventions where those have one."""
    USAGE_PROMPT_TOKENS = "gen_ai.usage.prompt_tokens"
    USAGE_COMPLETION_TOKENS = "gen_ai.usage.completion_tokens"
    REQUEST_MAX_TOKENS = "gen_ai.request.max_tokens"
    REQUEST_TOP_P = "gen_ai.request.top_p"
    REQUEST_TEMPERATURE = "gen_ai.request.temperature"
    REQUEST_N = "gen_ai.request.n"
    REQUEST_ID = "gen_ai.request.id"
    RESPONSE_MODEL = "gen_ai.response.model"
    TIME_IN_QUEUE = "gen_ai.latency.time_in_queue"
    TIME_TO_FIRST_TOKEN = "gen_ai.latency.time_to_first_token"
    E2E = "gen_ai.latency.e2e"
    TIME_IN_MODEL_PREFILL = "gen_ai.latency.time_in_model_prefill"
    TIME_IN_MODEL_DECODE = "gen_ai.latency.time_in_model_decode"
    TIME_IN_MODEL_INFERENCE = "gen_ai.latency.time_in_model_inference"
    TIME_IN_MODEL_FORWARD = "gen_ai.latency.time_in_model_forward"
    TIME_IN_MODEL_EXECUTE = "gen_ai.latency.time_in_model_execute"


# RequestOutput.metrics key, the attribute it becomes, and the collect_detailed_traces values that add it.
_MODEL_TIMES = (("model_forward_time", SpanAttributes.TIME_IN_MODEL_FORWARD, ("model", "all")),
                ("model_execute_time", SpanAttributes.TIME_IN_MODEL_EXECUTE, ("worker", "all")))


@dataclass(frozen=True)
class _Started:
    headers: dict[str, str]
    params: SamplingParams


class RequestSpans:
    def __init__(self, endpoint: str, model_name: str, detailed: Optional[str] = None) -> None:
        """detailed: collect_detailed_traces (settings.DETAILED_TRACES); any value makes the engine core's
        scheduling moments the span's events."""
        self.tracer, self.provider = otel.make_tracer(endpoint)
        self.model_name = model_name
        self.detailed = detailed is not None
        # vLLM's meaning of the values: "model" adds the forward's time, "worker" the executor's, "all" both.
        self.model_times = {name: attribute for name, attribute, values in _MODEL_TIMES if detailed in values}
        self._started: dict[str, _Started] = {}

    def begin(self, prepared: PreparedRequest) -> None:
        """Called before the request's engine requests are sent: with model or worker times to report, they
        ask the engine core to time the steps they are in."""
        self._started[prepared.request_id] = _Started(dict(current_trace_headers()), prepared.params)
        if self.model_times:
            for request in prepared.requests:
                request.trace_model_times = True

    def drop(self, request_id: str) -> None:
        self._started.pop(request_id, None)

    def finish(self, out: RequestOutput, num_output_tokens: int, engine: int = 0) -> None:
        started = self._started.pop(out.request_id, None)
        if started is None:          # a request another path started (none today): nothing to parent it to
            return
        t = out.metrics
        arrival, last = t["arrival_time"], t.get("last_token_time", t["arrival_time"])
        attributes = {**_latencies(t), **_request_params(started.params),
                      **{attribute: t[name] for name, attribute in self.model_times.items() if name in t},
                      SpanAttributes.USAGE_PROMPT_TOKENS: len(out.prompt_token_ids),
                      SpanAttributes.USAGE_COMPLETION_TOKENS: num_output_tokens,
                      SpanAttributes.REQUEST_ID: out.request_id,
                      SpanAttributes.RESPONSE_MODEL: self.model_name}
        span = self.tracer.start_span(SPAN_NAME, context=otel.parent_context(started.headers),
                                      kind=otel.server_kind(), attributes=attributes,
                                      start_time=int(arrival * 1e9))
        if self.detailed:
            for event in out.events:
                span.add_event(event.kind, timestamp=int((arrival + event.seconds) * 1e9))
        span.end(end_time=int(last * 1e9))

    def shutdown(self) -> None:
        """Export what is still queued (bounded by the SDK's export timeout)."""
        self.provider.shutdown()


def _latencies(t: dict[str, float]) -> dict[str, float]:
    """vLLM's phases, from durations (the engine core may run on another host with another clock)."""
    arrival, first, last, queue = (t.get("arrival_time"), t.get("first_token_time"), t.get("last_token_time"),
                                   t.get("queue_time"))
    out: dict[str, float] = {}
    if last is not None:
        out[SpanAttributes.E2E] = max(0.0, last - arrival)
    if queue is not None:
        out[SpanAttributes.TIME_IN_QUEUE] = queue
    if first is None:
        return out
    ttft = max(0.0, first - arrival)
    out[SpanAttributes.TIME_TO_FIRST_TOKEN] = ttft
    if queue is not None:
        out[SpanAttributes.TIME_IN_MODEL_PREFILL] = max(0.0, ttft - queue)
    if last is not None:
        out[SpanAttributes.TIME_IN_MODEL_DECODE] = max(0.0, last - first)
        if queue is not None:
            out[SpanAttributes.TIME_IN_MODEL_INFERENCE] = max(0.0, last - arrival - queue)
    return out


def _request_params(params: SamplingParams) -> dict[str, Any]:
    """The request's own settings, those it set (as vLLM: a zero or unset one is left out)."""
    values = {SpanAttributes.REQUEST_MAX_TOKENS: params.max_tokens, SpanAttributes.REQUEST_TOP_P: params.top_p,
              SpanAttributes.REQUEST_TEMPERATURE: params.temperature, SpanAttributes.REQUEST_N: params.n}
    return {name: value for name, value in values.items() if value}
