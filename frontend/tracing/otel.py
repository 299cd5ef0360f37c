"""The OpenTelemetry SDK's tracer provider with an OTLP exporter: the only module that imports the SDK.

The protocol is OpenTelemetry's own variable, OTEL_EXPORTER_OTLP_TRACES_PROTOCOL (grpc by default, as vLLM;
or http/protobuf), and the exporter reads the rest of the OTEL_EXPORTER_OTLP_TRACES_* variables (headers,
timeout, compression, certificates) itself. Spans leave on the SDK's batch processor thread: a slow or absent
collector costs requests nothing."""
from __future__ import annotations

from typing import Any

from pagedserve.common import envs

INSTALL_HINT = "pip install 'pagedserve[otel]'"


def make_tracer(endpoint: str, service_name: str = "pagedserve") -> tuple[Any, Any]:
    """(tracer, provider) exporting to `endpoint`; ValueError names a missing package's extra, or a bad
    OTEL_EXPORTER_OTLP_TRACES_PROTOCOL."""
    protocol = envs.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
        if protocol == "grpc":
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    except ImportError as exc:
        raise ValueError(f"--otlp-traces-endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                          f"{INSTALL_HINT} ({exc})") from exc
    provider = TracerProvider(resource=Resource.create({"service.name": service_name}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider.get_tracer("pagedserve.frontend"), provider


def parent_context(headers: dict[str, str]) -> Any:
    """The caller's span context from its W3C headers (None when it sent none: the span is a root)."""
    if not headers:
        return None
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
    return TraceContextTextMapPropagator().extract(headers)


def server_kind() -> Any:
    from opentelemetry.trace import SpanKind
    return SpanKind.SERVER
