"""A real OTLP/HTTP trace receiver for the tests: POST /v1/traces with a protobuf ExportTraceServiceRequest
(decoded with opentelemetry-proto), answered as a collector answers; the spans it got, waited on by condition."""
from __future__ import annotations

import threading
import time
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


class OtlpReceiver:
    def __init__(self, port: int) -> None:
        self.spans: list[Any] = []
        self.changed = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:          # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                request = ExportTraceServiceRequest.FromString(body)
                with receiver.changed:
                    for resource in request.resource_spans:
                        for scope in resource.scope_spans:
                            receiver.spans.extend(scope.spans)
                    receiver.changed.notify_all()
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

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
