"""Data parallelism: `engine-serve --data-parallel-size 2` runs two engine cores behind one API server.

Requests reach both engines; /health lists each engine; /metrics labels every series with its engine. The
prefix router sends prompts that share a system prompt to the engine that holds it, so on a workload of three
system prompts interleaved the engines' prefix caches hit more than with least-loaded routing, which spreads
each system prompt over both engines and computes it twice.
"""
from __future__ import annotations

import httpx
import pytest

from pagedserve.frontend.dp_router import PrefixRouter
from pagedserve.tests.helpers.server import Server

SYSTEMS = [f"System prompt number {i}: " + " ".join(f"rule {i}.{j} is to be followed." for j in range(12))
           for i in range(3)]


def _series(server: Server, name: str) -> dict[str, float]:
    """engine label -> value of a vllm:* series."""
    text = httpx.get(f"{server.url}/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + "_total{"):
            labels, value = line.rsplit(" ", 1)
            engine = labels.split('engine="')[1].split('"')[0]
            out[engine] = out.get(engine, 0.0) + float(value)
    return out


def _shared_prefix_workload(server: Server) -> float:
    """Twelve requests, three system prompts interleaved, one at a time (an odd count: least-loaded's round
    robin sends each system prompt to both engines in turn); the prefix-cache hit share."""
    client = server.client()
    for round_ in range(4):
        for i, system in enumerate(SYSTEMS):
            client.completions.create(model=client.models.list().data[0].id,
                                      prompt=f"{system} Question {round_}.{i}:", max_tokens=2, temperature=0.0)
    server.wait_idle()
    hits, queries = _series(server, "vllm:prefix_cache_hits"), _series(server, "vllm:prefix_cache_queries")
    assert set(hits) == {"0", "1"}
    return sum(hits.values()) / sum(queries.values())


def test_two_engines_serve_report_and_route_by_prefix(tiny_serving_model):
    shares = {}
    for routing in ("prefix", "least-loaded"):
        server = Server("--data-parallel-size", "2", "--data-parallel-routing", routing, "--kv-cache-memory",
                        "0.05", model=tiny_serving_model, token=None, max_model_len=512)
        try:
            health = httpx.get(f"{server.url}/health", timeout=10)
            assert health.status_code == 200
            assert [e["state"] for e in health.json()["engines"]] == ["ok", "ok"]
            shares[routing] = _shared_prefix_workload(server)
            served = _series(server, "vllm:request_success")
            assert sum(served.values()) == 12 and min(served.values()) >= 4, served    # both engines served
        finally:
            server.stop()
    # Least-loaded computes each system prompt on both engines, the prefix router on one.
    assert shares["prefix"] > shares["least-loaded"] + 0.1, shares


def test_router_prefers_the_prefix_holder_until_it_is_clearly_busier():
    """The holder of a prompt's prefix gets it while its load is within 4 of the least loaded engine's; past
    that the least loaded one does (and holds the prefix from then on, so it shares the rest)."""
    router = PrefixRouter(2, block_size=4, capacity_blocks=100)
    system = list(range(100, 140))
    routes = [router.route(system + [i]) for i in range(8)]
    first = routes[0]
    assert routes == [first] * 5 + [1 - first] * 3
    assert router.loads[first] == 5 and router.loads[1 - first] == 3
    router.finished(first)
    assert router.loads[first] == 4
    fresh = router.route(list(range(300, 340)))            # no prefix anywhere: the least loaded
    assert fresh == 1 - first
    least = PrefixRouter(2, block_size=4, capacity_blocks=100, policy="least-loaded")
    assert [least.route(system) for _ in range(4)] == [0, 1, 0, 1]    # equal loads: round robin
    with pytest.raises(ValueError, match="data_parallel_routing"):
        PrefixRouter(2, 4, 100, policy="random")


def test_one_engine_apis_refuse_data_parallelism(tiny_serving_model):
    from pagedserve import LLM
    from pagedserve.common.config import EngineArgs
    from pagedserve.frontend.async_client import AsyncEngineClient
    from pagedserve.frontend.cli import main
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(tiny_serving_model, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        AsyncEngineClient.from_engine_args(EngineArgs(model=tiny_serving_model, data_parallel_size=2))
    with pytest.raises(SystemExit, match="--engine-address"):
        main([tiny_serving_model, "-dp", "2", "--engine-address", "ipc:///tmp/x"])
