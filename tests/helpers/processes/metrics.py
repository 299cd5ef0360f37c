"""The one reader of engine-serve's Prometheus /metrics, for the tests and the soak script."""
from __future__ import annotations

import collections
import ssl
import time

import httpx

# vLLM's names, and pagedserve's own for what vLLM has no metric for; no name is under both.
PREFIXES = ("vllm:", "pagedserve:")


def parse_metrics(text: str) -> dict[str, float]:
    """The vllm:* and pagedserve:* samples of a /metrics page by name (prefix dropped), summed over their
    labels.

    Summing is what a check wants: the server labels its series by model name, and there is one model.
    A name with no sample reads as 0 (a defaultdict), so `name in result` tells whether it was exported.
    """
    values: dict[str, float] = collections.defaultdict(float)
    for line in text.splitlines():
        prefix = next((p for p in PREFIXES if line.startswith(p)), None)
        if prefix is not None:
            name = line.split("{", 1)[0].split(" ", 1)[0][len(prefix):]
            values[name] += float(line.rsplit(" ", 1)[1])
    return values


def read_metrics(url: str, verify: ssl.SSLContext | bool = True) -> dict[str, float]:
    """parse_metrics of GET {url}/metrics."""
    return parse_metrics(httpx.get(f"{url}/metrics", timeout=10, verify=verify).text)


def is_idle(m: dict[str, float]) -> bool:
    """Nothing running, nothing waiting, and every KV block back in the pool."""
    return not (m["num_requests_running"] or m["num_requests_waiting"] or m["kv_cache_usage_perc"])


def wait_idle(url: str, timeout_s: float = 30, verify: ssl.SSLContext | bool = True) -> dict[str, float]:
    """Metrics once the server is idle, or the last reading at the timeout (the caller asserts on it).

    Polled: KV usage is reported by the step that emptied the batch, which can come a little after the
    last response did.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        m = read_metrics(url, verify)
        if is_idle(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.2)
