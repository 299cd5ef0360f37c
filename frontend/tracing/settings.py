"""The two tracing settings, checked once for both the server's flags and the offline LLM's arguments
(vLLM's names: --otlp-traces-endpoint / otlp_traces_endpoint, --collect-detailed-traces /
collect_detailed_traces). Importing this imports no OpenTelemetry."""
from __future__ import annotations

from typing import Callable, Optional

from pagedserve.common import envs

# vLLM's values: "model" adds the model's forward time, "worker" the worker's execute time, "all" both; every
# value adds the engine core's scheduling events.
DETAILED_TRACES = ("all", "model", "worker")


def as_flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def check_tracing(endpoint: Optional[str], detailed: Optional[str],
                  spell: Callable[[str], str] = as_flag) -> None:
    """ValueError naming the setting (spelt by `spell`: a flag, or the LLM argument) for values that cannot
    trace; a bad OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is read (and refused) only when an endpoint is set."""
    if detailed is not None and detailed not in DETAILED_TRACES:
        raise ValueError(f"{spell('collect_detailed_traces')} must be one of {', '.join(DETAILED_TRACES)}, "
                         f"got {detailed!r}")
    if detailed and not endpoint:
        raise ValueError(f"{spell('collect_detailed_traces')} needs {spell('otlp_traces_endpoint')} (the spans "
                         "it adds to)")
    if endpoint:
        envs.OTEL_EXPORTER_OTLP_TRACES_PROTOCOL        # ValueError, naming the variable, for a bad one
