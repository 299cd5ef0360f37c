"""The engine core's side of OpenTelemetry traces (frontend/tracing/, docs/tracing.md)."""
