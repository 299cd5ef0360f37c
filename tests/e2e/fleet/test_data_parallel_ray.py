"""`engine-serve --data-parallel-size 2 --data-parallel-backend ray`: the engine cores placed by Ray.

On a real two-node Ray cluster on this machine (a head and a second raylet, one logical CPU each), each engine
core lands on its own node, both serve, and a SIGKILLed one fails only its own streams and is started again on
the cluster while the other serves; stopping the server leaves no engine actor or core behind."""
from __future__ import annotations

import os
import signal
import time

import httpx
import psutil
import pytest
import ray

from pagedserve.common.ray_utils import RAY_NAMESPACE
from pagedserve.frontend.cli import main
from pagedserve.tests.helpers.processes.ray_cluster import two_node_cluster
from pagedserve.tests.helpers.processes.server import Server
from pagedserve.tests.helpers.processes.traffic import start_streams


@pytest.fixture(scope="module")
def two_nodes():
    with two_node_cluster() as cluster:
        yield cluster


def _engine_hosts() -> dict[str, object]:
    """name -> actor of every engine host on the cluster."""
    return {a["name"]: ray.get_actor(a["name"], namespace=RAY_NAMESPACE)
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a["namespace"] == RAY_NAMESPACE and a["name"].startswith("pagedserve-engine-")}


def _served_per_engine(server: Server) -> dict[str, float]:
    out: dict[str, float] = {}
    for line in httpx.get(f"{server.url}/metrics", timeout=10).text.splitlines():
        if line.startswith("vllm:request_success_total{"):
            labels, value = line.rsplit(" ", 1)
            engine = labels.split('engine="')[1].split('"')[0]
            out[engine] = out.get(engine, 0.0) + float(value)
    return out


def test_engines_on_two_ray_nodes_serve_and_heal(two_nodes, tiny_serving_model, monkeypatch):
    monkeypatch.setenv("RAY_ADDRESS", two_nodes.address)
    server = Server("--data-parallel-size", "2", "--data-parallel-backend", "ray", "--data-parallel-routing",
                    "least-loaded", "--kv-cache-memory", "0.05", model=tiny_serving_model, token=None,
                    max_model_len=512)
    core_pids: list[int] = []
    try:
        hosts = _engine_hosts()
        assert len(hosts) == 2
        assert len(set(ray.get([h.node_id.remote() for h in hosts.values()]))) == 2   # one engine per node
        assert [e["state"] for e in httpx.get(f"{server.url}/health", timeout=10).json()["engines"]] == ["ok", "ok"]
        client = server.client()
        model = client.models.list().data[0].id
        streams = start_streams(client, model, 4)      # least-loaded: two streams on each engine
        streams.wait_streaming()                         # all four running, two on each engine
        ended = streams.ended
        victim = sorted(hosts)[1]
        core_pids = ray.get([h.core_pid.remote() for h in hosts.values()])
        killed_at = time.monotonic()
        os.kill(ray.get(hosts[victim].core_pid.remote()), signal.SIGKILL)
        streams.join()
        failed = [i for i, (how, _) in ended.items() if how != "done"]
        assert len(ended) == 4 and len(failed) == 2, ended
        assert all(ended[i][1] - killed_at < 1.0 for i in failed), ended
        assert client.completions.create(model=model, prompt="Still there?", max_tokens=4).choices[0].text is not None
        deadline = time.monotonic() + 90                 # a new engine host, placed where the old one was freed
        while httpx.get(f"{server.url}/health", timeout=10).json()["status"] != "ok":
            assert time.monotonic() < deadline, httpx.get(f"{server.url}/health", timeout=10).json()
            time.sleep(0.5)
        assert victim not in _engine_hosts() and len(_engine_hosts()) == 2
        for i in range(4):
            client.completions.create(model=model, prompt=f"Again {i}:", max_tokens=4)
        assert min(_served_per_engine(server).values()) >= 3
        core_pids += ray.get([h.core_pid.remote() for h in _engine_hosts().values()])
    finally:
        server.stop()
    deadline = time.monotonic() + 20                     # no engine host or core outlives the server
    while _engine_hosts() or any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
                                 for p in core_pids):
        assert time.monotonic() < deadline, (_engine_hosts(), core_pids)
        time.sleep(0.3)


@pytest.mark.parametrize("flags,match", [
    (["--headless", "--data-parallel-address", "127.0.0.1", "--engine-token", "t"], "--headless places"),
    (["--data-parallel-size-local", "1"], "--data-parallel-size-local places"),
])
def test_hand_placement_flags_are_refused_with_ray(tiny_serving_model, flags, match):
    with pytest.raises(SystemExit, match=match):
        main([tiny_serving_model, "-dp", "2", "--data-parallel-backend", "ray", *flags])
