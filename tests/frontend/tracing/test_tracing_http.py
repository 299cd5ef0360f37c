"""--otlp-traces-endpoint (issue 51): a real engine-serve sends one span per request, vLLM's `llm_request` with
its gen_ai.* attributes, to a real OTLP/HTTP receiver; a caller's traceparent makes it the span's parent; a
collector that is down costs requests nothing; without the flag the SDK is never imported."""
from __future__ import annotations

import concurrent.futures
import os
import secrets
import subprocess
import sys

import httpx
import pytest

from pagedserve.tests.helpers.processes.otlp_receiver import OtlpReceiver, attributes
from pagedserve.tests.helpers.processes.server import Server, free_port

pytestmark = pytest.mark.timeout(300)

KV_BLOCKS = 40                # of 16 tokens
SPAN_KIND_SERVER = 2          # opentelemetry.proto.trace.v1.Span.SpanKind.SPAN_KIND_SERVER


@pytest.fixture(scope="module")
def receiver_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def receiver(receiver_port):
    r = OtlpReceiver(receiver_port)
    yield r
    r.close()


@pytest.fixture(scope="module")
def traced_server(tiny_serving_model, receiver):
    env = {"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": "http/protobuf", "OTEL_BSP_SCHEDULE_DELAY": "100"}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        # A pool of KV_BLOCKS blocks: long requests side by side preempt one another (detailed traces show it).
        server = Server("--num-gpu-blocks-override", str(KV_BLOCKS), "--collect-detailed-traces", "all",
                        "--otlp-traces-endpoint", f"http://127.0.0.1:{receiver.server.server_address[1]}/v1/traces",
                        model=tiny_serving_model, max_model_len=512)
    finally:
        for k, v in saved.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    yield server
    server.stop()


def _traceparent() -> tuple[str, str, str]:
    trace_id, span_id = secrets.token_hex(16), secrets.token_hex(8)
    return f"00-{trace_id}-{span_id}-01", trace_id, span_id


def _of_trace(trace_id: str):
    return lambda span: span.trace_id.hex() == trace_id


def test_a_span_per_request_joins_the_callers_trace(traced_server, receiver):
    header, trace_id, parent_id = _traceparent()
    body = {"model": traced_server.client().models.list().data[0].id, "prompt": "Once upon a time",
            "max_tokens": 5, "temperature": 0.5, "top_p": 0.9, "ignore_eos": True}
    resp = httpx.post(f"{traced_server.url}/v1/completions", json=body,
                      headers={**traced_server.auth, "traceparent": header}, timeout=60).json()
    [span] = receiver.wait_for(_of_trace(trace_id))
    assert span.name == "llm_request" and span.kind == SPAN_KIND_SERVER
    assert span.parent_span_id.hex() == parent_id
    a = attributes(span)
    assert a["gen_ai.usage.prompt_tokens"] == resp["usage"]["prompt_tokens"]
    assert a["gen_ai.usage.completion_tokens"] == 5
    assert (a["gen_ai.request.max_tokens"], a["gen_ai.request.temperature"]) == (5, 0.5)
    assert a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.id"].startswith(resp["id"])
    assert a["gen_ai.response.model"] == body["model"]
    for name in ("time_in_queue", "time_to_first_token", "e2e", "time_in_model_prefill",
                 "time_in_model_decode", "time_in_model_inference"):
        assert a[f"gen_ai.latency.{name}"] >= 0, name
    assert a["gen_ai.latency.time_to_first_token"] <= a["gen_ai.latency.e2e"]
    # --collect-detailed-traces all: the model's times, summed over the request's steps in the engine core.
    forward, execute = a["gen_ai.latency.time_in_model_forward"], a["gen_ai.latency.time_in_model_execute"]
    assert 0 < forward <= execute <= a["gen_ai.latency.e2e"]     # the steps it was in lie within its life
    # The span runs from the request's arrival to its last token.
    duration = (span.end_time_unix_nano - span.start_time_unix_nano) / 1e9
    assert duration == pytest.approx(a["gen_ai.latency.e2e"], abs=1e-3)


def test_32_concurrent_streams_each_get_their_own_span(traced_server, receiver):
    client = traced_server.client()
    model = client.models.list().data[0].id

    def stream(i: int) -> tuple[str, str, int]:
        header, trace_id, parent_id = _traceparent()
        chunks = client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": f"count to {i}"}], max_tokens=3 + i % 5,
            stream=True, extra_body={"ignore_eos": True}, extra_headers={"traceparent": header})
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        return trace_id, parent_id, 3 + i % 5

    with concurrent.futures.ThreadPoolExecutor(32) as pool:
        sent = list(pool.map(stream, range(32)))
    for trace_id, parent_id, max_tokens in sent:
        [span] = receiver.wait_for(_of_trace(trace_id))
        assert span.parent_span_id.hex() == parent_id
        assert attributes(span)["gen_ai.usage.completion_tokens"] == max_tokens


def test_a_request_without_trace_context_is_a_root_span(traced_server, receiver):
    resp = traced_server.client().completions.create(model=traced_server.client().models.list().data[0].id,
                                                     prompt="root", max_tokens=2)
    [span] = receiver.wait_for(lambda s: attributes(s)["gen_ai.request.id"].startswith(resp.id))
    assert span.parent_span_id == b""


def test_detailed_traces_carry_the_scheduling_moments_preemptions_included(traced_server, receiver):
    """Four requests of 300 tokens need ~80 blocks of a pool of 40: the scheduler preempts, and each span
    says when its request was queued, scheduled, preempted and scheduled again, in order, inside the span."""
    client = traced_server.client()
    model = client.models.list().data[0].id

    def long(i: int) -> str:
        header, trace_id, _ = _traceparent()
        client.completions.create(model=model, prompt=f"long {i}", max_tokens=300, extra_body={"ignore_eos": True},
                                  extra_headers={"traceparent": header})
        return trace_id

    preemptions_before = traced_server.metric("num_preemptions_total")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        trace_ids = list(pool.map(long, range(4)))
    assert traced_server.metric("num_preemptions_total") > preemptions_before
    kinds_seen = set()
    for trace_id in trace_ids:
        [span] = receiver.wait_for(_of_trace(trace_id))
        kinds = [e.name for e in span.events]
        times = [e.time_unix_nano for e in span.events]
        assert kinds[:2] == ["QUEUED", "SCHEDULED"] and times == sorted(times), kinds
        assert span.start_time_unix_nano <= times[0] and times[-1] <= span.end_time_unix_nano
        # Every preemption is followed by a new scheduling.
        assert kinds.count("SCHEDULED") == kinds.count("PREEMPTED") + 1, kinds
        kinds_seen.update(kinds)
    assert "PREEMPTED" in kinds_seen


def test_detailed_traces_need_an_endpoint():
    from pagedserve.frontend.server_args import ServerArgs
    with pytest.raises(ValueError, match="--collect-detailed-traces needs --otlp-traces-endpoint"):
        ServerArgs(collect_detailed_traces="all", otlp_traces_endpoint=None)


def test_a_collector_that_is_down_costs_requests_nothing(traced_server, receiver, receiver_port):
    receiver.close()                        # the module's last use of it: every later span is refused
    client = traced_server.client()
    model = client.models.list().data[0].id
    for i in range(8):
        out = client.completions.create(model=model, prompt=f"down {i}", max_tokens=4, extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 4
    assert traced_server.health() == 200
    # Back up on the same port: spans flow again.
    again = OtlpReceiver(receiver_port)
    try:
        header, trace_id, _ = _traceparent()
        httpx.post(f"{traced_server.url}/v1/completions", json={"model": model, "prompt": "up", "max_tokens": 2},
                   headers={**traced_server.auth, "traceparent": header}, timeout=60).raise_for_status()
        again.wait_for(_of_trace(trace_id), timeout_s=60)
    finally:
        again.close()


def test_off_by_default_the_sdk_is_never_imported():
    code = ("import sys; import pagedserve.frontend.cli, pagedserve.frontend.api_server;"
            "from pagedserve.frontend.server_args import ServerArgs; ServerArgs();"
            "print(sorted(m for m in sys.modules if m.startswith(('opentelemetry.sdk', 'opentelemetry.exporter'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def test_a_bad_protocol_is_refused_naming_the_variable(monkeypatch):
    from pagedserve.frontend.server_args import ServerArgs
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "carrier-pigeon")
    env = dict(os.environ, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL="carrier-pigeon")
    code = ("from pagedserve.frontend.server_args import ServerArgs;"
            "ServerArgs(otlp_traces_endpoint='http://127.0.0.1:1/v1/traces')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode != 0 and "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL" in out.stderr, out.stderr[-2000:]
    # Without an endpoint the variable is not read: tracing off never fails a start.
    assert ServerArgs(otlp_traces_endpoint=None).otlp_traces_endpoint is None
