"""The offline LLM traces as the server does (issue 51): `LLM(otlp_traces_endpoint=...)`, vLLM's argument, sends one
`llm_request` span per request of `generate` and `chat`, with the server's attributes, to real OTLP receivers,
over OTLP/HTTP and over gRPC (vLLM's and the SDK's default protocol: no variable set). `shutdown` sends what is
still queued: the spans are there when it returns, long before the batch processor's own schedule."""
from __future__ import annotations

from collections.abc import Iterator

import pytest

from pagedserve.common.params.sampling_params import SamplingParams
from pagedserve.frontend.offline.llm import LLM
from pagedserve.tests.helpers.processes.otlp_receiver import OtlpGrpcReceiver, OtlpReceiver, attributes
from pagedserve.tests.helpers.processes.server import free_port

pytestmark = pytest.mark.timeout(300)

SPAN_KIND_SERVER = 2          # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER
ENGINE = {"dtype": "float32", "max_model_len": 256, "kv_cache_memory": 0.05}
# The attributes of a span of a request that set max_tokens, temperature and top_p (tests/frontend/tracing/
# test_tracing_http.py checks the server's).
ATTRIBUTES = {"gen_ai.usage.prompt_tokens", "gen_ai.usage.completion_tokens", "gen_ai.request.max_tokens",
              "gen_ai.request.temperature", "gen_ai.request.top_p", "gen_ai.request.n", "gen_ai.request.id",
              "gen_ai.response.model", "gen_ai.latency.time_in_queue", "gen_ai.latency.time_to_first_token",
              "gen_ai.latency.e2e", "gen_ai.latency.time_in_model_prefill", "gen_ai.latency.time_in_model_decode",
              "gen_ai.latency.time_in_model_inference"}
MODEL_TIMES = {"gen_ai.latency.time_in_model_forward", "gen_ai.latency.time_in_model_execute"}


@pytest.fixture
def slow_batches(monkeypatch):
    """The batch processor would wait 60 s before it sends: only LLM.shutdown's flush gets spans out in time."""
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "60000")


def by_id(spans: list) -> dict[str, object]:
    return {attributes(s)["gen_ai.request.id"]: s for s in spans}


@pytest.fixture
def http_receiver(monkeypatch) -> Iterator[tuple[OtlpReceiver, str]]:
    """A real OTLP/HTTP receiver and the traces endpoint to give the LLM."""
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "http/protobuf")
    port = free_port()
    receiver = OtlpReceiver(port)
    try:
        yield receiver, f"http://127.0.0.1:{port}/v1/traces"
    finally:
        receiver.close()


def test_generate_and_chat_send_a_span_per_request_over_http(tiny_serving_model, http_receiver, slow_batches):
    receiver, endpoint = http_receiver
    with LLM(tiny_serving_model, **ENGINE, otlp_traces_endpoint=endpoint, collect_detailed_traces="all") as llm:
        params = [SamplingParams(max_tokens=3 + i, temperature=0.5, top_p=0.9, ignore_eos=True) for i in range(3)]
        outs = llm.generate(["Once upon", "a time there", "was a tiny model"], params, use_tqdm=False)
        [chat] = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=2, ignore_eos=True),
                          use_tqdm=False)
        model = llm.info.served_model_name
        assert not llm.engine.model_times         # every traced request finished: none is left tracked
        assert receiver.spans == []            # nothing left yet: the batch processor waits
    spans = by_id(receiver.wait_for(lambda s: True, count=4, timeout_s=0))
    assert set(spans) == {o.request_id for o in [*outs, chat]}
    for out, p in zip(outs, params):
        span = spans[out.request_id]
        a = attributes(span)
        assert span.name == "llm_request" and span.kind == SPAN_KIND_SERVER and span.parent_span_id == b""
        assert set(a) == ATTRIBUTES | MODEL_TIMES            # "all": the model's times as well
        # Sums over the steps the request was in: the forward is part of the executor's step, and both lie within
        # its life (its last step ends after its last token is stamped, so not within time_in_model_inference).
        forward, execute = a["gen_ai.latency.time_in_model_forward"], a["gen_ai.latency.time_in_model_execute"]
        assert 0 < forward <= execute <= a["gen_ai.latency.e2e"]     # the steps it was in lie within its life
        assert (out.metrics["model_forward_time"], out.metrics["model_execute_time"]) == (forward, execute)
        assert a["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
        assert a["gen_ai.usage.completion_tokens"] == len(out.outputs[0].token_ids) == p.max_tokens
        assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (p.max_tokens, 0.5)
        assert a["gen_ai.request.top_p"] == pytest.approx(0.9) and a["gen_ai.response.model"] == model
        assert 0 <= a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
        duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
        assert duration == pytest.approx(a["gen_ai.latency.e2e"], abs=1e-3)
        # collect_detailed_traces: the engine core's moments, inside the span.
        assert [e.name for e in span.events][:2] == ["QUEUED", "SCHEDULED"]
        assert all(span.start_time_unix_nano <= e.time_unix_nano <= span.end_time_unix_nano for e in span.events)
    assert attributes(spans[chat.request_id])["gen_ai.usage.completion_tokens"] == 2


def test_grpc_is_the_default_protocol(tiny_serving_model, monkeypatch, slow_batches):
    """No OTEL_EXPORTER_OTLP_TRACES_PROTOCOL: the SDK's OTLP/gRPC exporter, which reads the other OTEL_ variables
    itself (the headers reach the receiver as gRPC metadata)."""
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", raising=False)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_HEADERS", "x-tenant=t51")
    port = free_port()
    receiver = OtlpGrpcReceiver(port)
    try:
        with LLM(tiny_serving_model, **ENGINE, otlp_traces_endpoint=f"http://127.0.0.1:{port}") as llm:
            outs = llm.generate(["over grpc", "twice"], SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False)
        spans = by_id(receiver.wait_for(lambda s: True, count=2, timeout_s=0))
    finally:
        receiver.close()
    assert set(spans) == {o.request_id for o in outs}
    for out in outs:
        a = attributes(spans[out.request_id])
        assert a["gen_ai.usage.completion_tokens"] == 4 and a["gen_ai.usage.prompt_tokens"] == len(out.prompt_token_ids)
        assert spans[out.request_id].events == []          # no collect_detailed_traces: no events
        assert not MODEL_TIMES & set(a) and "model_execute_time" not in out.metrics     # nor model times
    assert receiver.metadata.get("x-tenant") == "t51"


def test_worker_adds_the_execute_time_only(tiny_serving_model, http_receiver, slow_batches):
    """vLLM's values: "worker" times the executor's steps, "model" the forward; both add the events."""
    receiver, endpoint = http_receiver
    with LLM(tiny_serving_model, **ENGINE, otlp_traces_endpoint=endpoint, collect_detailed_traces="worker") as llm:
        llm.generate("worker", SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    [span] = receiver.wait_for(lambda s: True, timeout_s=0)
    a = attributes(span)
    assert a["gen_ai.latency.time_in_model_execute"] > 0 and "gen_ai.latency.time_in_model_forward" not in a
    assert [e.name for e in span.events][:2] == ["QUEUED", "SCHEDULED"]


def test_tracing_arguments_are_checked_before_the_engine_starts():
    with pytest.raises(ValueError, match="collect_detailed_traces needs otlp_traces_endpoint"):
        LLM("no-such-model", collect_detailed_traces="all")
    with pytest.raises(ValueError, match="collect_detailed_traces must be one of all, model, worker"):
        LLM("no-such-model", otlp_traces_endpoint="http://127.0.0.1:1", collect_detailed_traces="everything")
    with pytest.raises(ValueError, match="OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        with pytest.MonkeyPatch.context() as mp:
            mp.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
            LLM("no-such-model", otlp_traces_endpoint="http://127.0.0.1:1")
