"""OpenTelemetry traces (`--otlp-traces-endpoint`): one span per request, with vLLM's attribute names.

Off by default and free when off: nothing here imports the OpenTelemetry SDK until a tracer is made, and with
no endpoint no middleware or hook is installed (docs/tracing.md)."""
