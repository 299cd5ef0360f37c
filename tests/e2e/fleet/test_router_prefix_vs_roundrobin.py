"""Prefix-aware routing against round-robin (issue 49) over three real engine-serve replicas behind real routers:
the same multi-turn chat workload (tests/helpers/processes/router_workload.py, fresh prompts each run) once through
`--routing-logic prefix`, once through `roundrobin`; the prefix-cache hit rate read from the replicas' own
vllm:prefix_cache_hits / queries must be at least twice round-robin's.

The replicas serve the tiny random model with the embedded model's tokenizer and chat template: the hit rate is a
property of where prompts go and how they tokenize, not of the weights, and the embedded model's three replicas
took minutes here on a shared machine. The p50 TTFT, the embedded model's and noisy on two shared cores, is the
benchmark's (benchmarks/results/router_prefix_ab.py, benchmarks/results/router_prefix.jsonl)."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from pagedserve.tests.helpers.processes.router import Router
from pagedserve.tests.helpers.processes.router_workload import run_conversations
from pagedserve.tests.helpers.processes.server import API_KEY, Server

# Probes of 5 s: a replica deep in a prefill on a loaded CPU answers /health late; it must not flap in and out.
PROBES = ("--health-check-interval", "5")

pytestmark = pytest.mark.timeout(600)

REPLICA = ("--kv-cache-memory", "0.25", "--max-num-seqs", "4")


@pytest.fixture(scope="module")
def replicas(tiny_serving_model):
    with ThreadPoolExecutor(3) as pool:
        servers = list(pool.map(lambda _: Server(*REPLICA, model=tiny_serving_model, max_model_len=512), range(3)))
    yield servers
    for server in servers:
        server.stop()


def test_prefix_routing_doubles_the_hit_rate_of_round_robin(replicas):
    urls = [s.url for s in replicas]
    model = replicas[0].client().models.list().data[0].id
    results = {}
    for logic in ("prefix", "roundrobin"):
        router = Router(*urls, routing=logic, backend_key=API_KEY, extra=PROBES)
        try:
            results[logic] = run_conversations(router.client(), model, urls, salt=f"test-{logic}")
        finally:
            router.stop()
    prefix, rr = results["prefix"], results["roundrobin"]
    assert prefix.queries > 0 and rr.queries > 0
    assert prefix.hit_rate >= 2 * rr.hit_rate, (prefix, rr)
    # Prefix routing keeps each conversation on one replica: from the second turn on most of a prompt is cached.
    assert prefix.hit_rate > 0.5, prefix
