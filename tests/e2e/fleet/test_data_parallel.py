"""Data parallelism: `engine-serve --data-parallel-size 2` runs two engine cores behind one API server.

Requests reach both engines; /health lists each engine; /metrics labels every series with its engine. The
prefix router sends prompts that share a system prompt to the engine that holds it, so on a workload of three
system prompts interleaved the engines' prefix caches hit more than with least-loaded routing, which spreads
each system prompt over both engines and computes it twice.
"""
from __future__ import annotations

import httpx
import pytest

from pagedserve.frontend.dp.router import PrefixRouter
from pagedserve.tests.helpers.processes.server import Server
from pagedserve.tests.helpers.processes.traffic import start_streams

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
    from pagedserve.common.config.engine_args import EngineArgs
    from pagedserve.frontend.client.async_client import AsyncEngineClient
    from pagedserve.frontend.cli import main
    with pytest.raises(ValueError, match="data_parallel_size"):
        LLM(tiny_serving_model, data_parallel_size=2)
    with pytest.raises(ValueError, match="data_parallel_size"):
        AsyncEngineClient.from_engine_args(EngineArgs(model=tiny_serving_model, data_parallel_size=2))
    with pytest.raises(SystemExit, match="--engine-address"):
        main([tiny_serving_model, "-dp", "2", "--engine-address", "ipc:///tmp/x"])


def test_a_killed_engine_fails_only_its_streams_and_restarts(tiny_serving_model):
    """SIGKILL one of two engine cores under streaming load: its streams end with an error within a second,
    the other engine's streams finish, new requests succeed while /health says "degraded", and the restarted
    engine serves again; stopping the server leaves no process behind."""
    import os
    import signal
    import time

    import psutil
    server = Server("--data-parallel-size", "2", "--data-parallel-routing", "least-loaded", "--kv-cache-memory",
                    "0.05", model=tiny_serving_model, token=None, max_model_len=512)
    try:
        cores = [p for p in server.children() if p.name().startswith("ps-engine-core")]
        assert len(cores) == 2
        client = server.client()
        model = client.models.list().data[0].id
        # In order: least-loaded puts 0, 2 on one engine, 1, 3 on the other.
        streams = start_streams(client, model, 4)
        streams.wait_streaming()                         # all four running, two on each engine
        ended = streams.ended
        killed_at = time.monotonic()
        os.kill(cores[1].pid, signal.SIGKILL)
        streams.join()
        failed = [i for i, (how, _) in ended.items() if how != "done"]
        assert len(ended) == 4 and len(failed) == 2, ended
        assert all(ended[i][1] - killed_at < 1.0 for i in failed), ended
        health = httpx.get(f"{server.url}/health", timeout=10)
        assert health.status_code == 200 and health.json()["status"] in ("degraded", "ok")
        assert client.completions.create(model=model, prompt="Still there?", max_tokens=4).choices[0].text is not None
        deadline = time.monotonic() + 90
        while httpx.get(f"{server.url}/health", timeout=10).json()["status"] != "ok":
            assert time.monotonic() < deadline, httpx.get(f"{server.url}/health", timeout=10).json()
            time.sleep(0.5)
        for i in range(4):                  # both engines take work again
            client.completions.create(model=model, prompt=f"Again {i}:", max_tokens=4)
        assert min(_series(server, "vllm:request_success").values()) >= 3
        kids = server.children()
        assert len([p for p in kids if p.name().startswith("ps-engine-core")]) == 2
    finally:
        server.stop_and_check_clean()
    assert not [p for p in psutil.process_iter(["ppid"]) if p.info["ppid"] == server.proc.pid]


def test_restart_engine_on_failure_with_one_engine(tiny_serving_model, tmp_path):
    """--restart-engine-on-failure: one engine core SIGKILLed mid-stream: the stream ends with an error within a
    second, /health is 503 until the restarted core serves, then requests succeed again, and the LoRA adapters
    (one from --lora-modules, one loaded at run time, none of the unloaded one) answer as before the kill."""
    import os
    import signal
    import time

    from pagedserve.tests.helpers.models.lora_adapters import make_lora
    a, b, c = (make_lora(str(tmp_path / n), tiny_serving_model, r=4, alpha=8, seed=s)
               for n, s in (("a", 1), ("b", 2), ("c", 3)))
    server = Server("--restart-engine-on-failure", "--enable-lora", "--lora-modules", f"a={a}",
                    "--allow-runtime-lora-updating", model=tiny_serving_model, token=None, max_model_len=512)
    try:
        client = server.client()
        model = client.models.list().data[0].id
        for name, path in (("b", b), ("c", c)):
            assert httpx.post(f"{server.url}/v1/load_lora_adapter", headers=server.auth,
                              json={"lora_name": name, "lora_path": path}).status_code == 200
        assert httpx.post(f"{server.url}/v1/unload_lora_adapter", headers=server.auth,
                          json={"lora_name": "c"}).status_code == 200

        def answers() -> list[str]:
            return [client.completions.create(model=m, prompt="Tell me", max_tokens=6, temperature=0.0)
                    .choices[0].text for m in (model, "a", "b")]
        before = answers()
        assert len(set(before)) == 3
        core = next(p for p in server.children() if p.name().startswith("ps-engine-core"))
        stream = client.completions.create(model=model, prompt="Once", max_tokens=480, stream=True,
                                           extra_body={"ignore_eos": True})
        next(iter(stream))
        killed_at = time.monotonic()
        os.kill(core.pid, signal.SIGKILL)
        with pytest.raises(Exception):
            for _ in stream:
                pass
        assert time.monotonic() - killed_at < 1.0
        deadline, codes = time.monotonic() + 90, set()
        while (code := server.health()) != 200:
            codes.add(code)
            assert time.monotonic() < deadline, codes
            time.sleep(0.2)
        assert codes <= {503}
        assert answers() == before
        assert [m.id for m in client.models.list().data] == [model, "a", "b"]
        assert len([p for p in server.children() if p.name().startswith("ps-engine-core")]) == 1
    finally:
        server.stop_and_check_clean()


def test_a_headless_node_registers_its_engine_with_the_head(tiny_serving_model, tmp_path):
    """Two "nodes" on this machine: a head serving rank 0 and a headless node starting rank 1, which registers
    over TCP with the shared token; requests reach both engines."""
    import subprocess
    import sys

    from pagedserve.tests.helpers.processes.server import free_port
    rpc = free_port()
    common = [tiny_serving_model, "-dp", "2", "--data-parallel-size-local", "1", "--data-parallel-address",
              "127.0.0.1", "--data-parallel-rpc-port", str(rpc), "--max-model-len", "512", "--dtype", "float32",
              "--kv-cache-memory", "0.05"]
    log = open(tmp_path / "headless.log", "wb")
    headless = subprocess.Popen([sys.executable, "-m", "pagedserve.frontend.cli", *common, "--headless",
                                 "--data-parallel-start-rank", "1", "--engine-token", "node-secret"],
                                stdout=log, stderr=subprocess.STDOUT)
    try:
        server = Server(*common[1:], "--engine-token", "node-secret", model=tiny_serving_model, token=None,
                        max_model_len=None, dtype=None)
        try:
            client = server.client()
            model = client.models.list().data[0].id
            for i in range(6):
                client.completions.create(model=model, prompt=f"Hello {i}", max_tokens=3)
            served = _series(server, "vllm:request_success")
            assert served.get("0", 0) >= 1 and served.get("1", 0) >= 1, served
            assert [e["state"] for e in httpx.get(f"{server.url}/health", timeout=10).json()["engines"]] == ["ok"] * 2
        finally:
            server.stop()
    finally:
        headless.terminate()
        assert headless.wait(60) == 0, open(tmp_path / "headless.log").read()[-2000:]
