"""Real OTLP trace receivers for the tests, decoding with opentelemetry-proto as a collector does:
OtlpReceiver takes OTLP/HTTP (POST /v1/traces with a protobuf ExportTraceServiceRequest), OtlpGrpcReceiver takes
OTLP/gRPC (a grpcio server implementing opentelemetry.proto.collector.trace.v1.TraceService/Export, the
protocol vLLM and the SDK use by default). Both keep the spans they got, waited on by condition."""
from __future__ import annotations

import threading
import time
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (ExportTraceServiceRequest,
                                                                      ExportTraceServiceResponse)


def attributes(span: Any) -> dict[str, Any]:
    """A span's attributes as plain values."""
    out = {}
    for kv in span.attributes:
        kind = kv.value.WhichOneof("value")
        out[kv.key] = getattr(kv.value, kind)
    return out


class _Spans:
    """The spans received so far, by either transport."""

    def __init__(self) -> None:
        self.spans: list[Any] = []
        self.changed = threading.Condition()

    def add(self, request: ExportTraceServiceRequest) -> None:
        with self.changed:
            for resource in request.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
            self.changed.notify_all()

    def wait_for(self, match: Callable[[Any], bool], count: int = 1, timeout_s: float = 30) -> list[Any]:
        """The spans that match, once there are `count` of them (AssertionError at the timeout)."""
        deadline = time.monotonic() + timeout_s
        with self.changed:
            while True:
                found = [s for s in self.spans if match(s)]
                if len(found) >= count or time.monotonic() > deadline:
                    break
                self.changed.wait(max(0.0, deadline - time.monotonic()))
        assert len(found) >= count, f"{len(found)} of {count} spans arrived; {len(self.spans)} in all"
        return found


class OtlpReceiver(_Spans):
    def __init__(self, port: int) -> None:
        super().__init__()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:          # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                receiver.add(ExportTraceServiceRequest.FromString(body))
                reply = ExportTraceServiceResponse().SerializeToString()
                self.send_response(200 if self.path == "/v1/traces" else 404)
                self.send_header("content-type", "application/x-protobuf")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:
                pass

        ThreadingHTTPServer.allow_reuse_address = True
        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class OtlpGrpcReceiver(_Spans):
    def __init__(self, port: int) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
        super().__init__()
        receiver = self
        # What the request carried beyond spans: the metadata of the last Export (headers, for the tests).
        self.metadata: dict[str, str] = {}

        class TraceService(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request: ExportTraceServiceRequest, context: Any) -> ExportTraceServiceResponse:  # noqa: N802
                receiver.metadata = dict(context.invocation_metadata())
                receiver.add(request)
                return ExportTraceServiceResponse()

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(TraceService(), self.server)
        if self.server.add_insecure_port(f"127.0.0.1:{port}") != port:
            raise OSError(f"port {port} is taken")
        self.server.start()

    def close(self) -> None:
        self.server.stop(grace=None)
