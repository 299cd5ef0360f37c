"""`--routing-logic least-load` reads each replica's KV usage (vllm:kv_cache_usage_perc, scraped from its
/metrics with the queue gauges) as well as its queue (issue 49): over two real HTTP upstreams whose /metrics
say what we set, a replica with a full KV cache gets nothing while the other has room, even with the shorter
queue, and the choice follows the scrape when the two swap. No engine: seconds."""
from __future__ import annotations

import httpx
import pytest

from pagedserve.tests.helpers.processes.router import Router, StaticUpstream, wait_for

pytestmark = pytest.mark.timeout(120)


def _metrics(running: int, waiting: int, kv_usage: float) -> str:
    """A replica's /metrics as engine-serve writes these three gauges: one series per data-parallel engine
    (two engines here; KV usage is the fullest one's, queues add up)."""
    lines = []
    for name, values in (("vllm:num_requests_running", (running, 0)), ("vllm:num_requests_waiting", (waiting, 0)),
                         ("vllm:kv_cache_usage_perc", (kv_usage, kv_usage / 2))):
        lines += [f"# HELP {name} x", f"# TYPE {name} gauge"]
        lines += [f'{name}{{engine="{e}",model_name="m"}} {v}' for e, v in enumerate(values)]
    return "\n".join(lines) + "\n"


def _send(router: Router, n: int) -> None:
    for _ in range(n):
        r = httpx.post(f"{router.url}/v1/completions", headers=router.auth, timeout=10,
                       json={"model": "m", "prompt": "hi", "max_tokens": 1})
        assert r.status_code == 200, r.text


def _scraped(upstreams: list[StaticUpstream]) -> None:
    """Wait for two fresh scrapes of each: the router has read what /metrics says now."""
    marks = [u.metrics_reads for u in upstreams]
    wait_for(lambda: all(u.metrics_reads >= m + 2 for u, m in zip(upstreams, marks)), 20, "the router's scrapes")


def test_least_load_avoids_a_full_kv_cache_and_follows_the_scrape():
    full, roomy = StaticUpstream("m", 200, 0, _metrics(0, 0, 0.99)), StaticUpstream("m", 200, 0, _metrics(2, 1, 0.2))
    router = Router(full.url, roomy.url, routing="least-load")
    try:
        _scraped([full, roomy])
        _send(router, 8)       # one at a time: the router's own in-flight count stays 0 or 1 on each
        assert (full.posts, roomy.posts) == (0, 8)       # the idle queue with a full cache is passed over
        full.metrics, roomy.metrics = _metrics(2, 1, 0.2), _metrics(0, 0, 1.0)
        _scraped([full, roomy])
        _send(router, 8)
        assert (full.posts, roomy.posts) == (8, 8)
        # Both with room: the queues decide again (the empty one takes them).
        full.metrics, roomy.metrics = _metrics(3, 2, 0.3), _metrics(0, 0, 0.3)
        _scraped([full, roomy])
        _send(router, 4)
        assert (full.posts, roomy.posts) == (8, 12)
    finally:
        router.stop()
        full.close()
        roomy.close()
