"""The Ray Serve application a KubeRay RayService names (pagedserve.frontend.ray_serve:build_app), served by Ray
Serve on a local Ray cluster: the openai client lists the model, chats and streams through Serve's proxy, and
deleting the application ends the replica's engine core."""
from __future__ import annotations

import time

import openai
import psutil
import pytest
import ray
from ray import serve

from pagedserve.frontend.ray_serve import build_app
from pagedserve.tests.helpers.processes.server import free_port


def _replica_cores() -> set[int]:
    """Engine cores whose parent is a Ray Serve replica (Ray titles its actor processes ray::ServeReplica:...)."""
    cores = set()
    for proc in psutil.process_iter(["name", "ppid"]):
        if not (proc.info["name"] or "").startswith("ps-engine-core"):
            continue
        try:
            parent = " ".join(psutil.Process(proc.info["ppid"]).cmdline())
        except psutil.Error:
            continue
        if "ServeReplica" in parent:
            cores.add(proc.pid)
    return cores


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.Error:        # gone
            pass
    return alive


@pytest.fixture
def local_serve(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    ray.init(address="local", num_cpus=2, include_dashboard=False)     # never another module's cluster
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    try:
        yield port
    finally:
        serve.shutdown()
        ray.shutdown()


def test_serve_application_answers_the_openai_client(local_serve, tiny_serving_model):
    serve.run(build_app({"model": tiny_serving_model, "dtype": "float32", "max-model-len": 512,
                         "kv-cache-memory": 0.05, "enable-prefix-caching": False}),
              name="pagedserve", route_prefix="/")
    ours = _replica_cores()
    assert len(ours) == 1                                 # the replica started one engine core
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{local_serve}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    chat = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=6,
                                          temperature=0.0)
    assert chat.usage.completion_tokens == 6 and chat.choices[0].message.content
    pieces = [c.choices[0].text for c in client.completions.create(model=model, prompt="Once", max_tokens=6,
                                                                   temperature=0.0, stream=True) if c.choices]
    plain = client.completions.create(model=model, prompt="Once", max_tokens=6, temperature=0.0)
    assert "".join(pieces) == plain.choices[0].text
    with pytest.raises(openai.BadRequestError):           # the server's own validation, through Serve
        client.completions.create(model=model, prompt="Once", max_tokens=-1)
    serve.delete("pagedserve")
    deadline = time.monotonic() + 20
    while _alive(ours):
        assert time.monotonic() < deadline, "the replica's engine core outlived it"
        time.sleep(0.3)


def test_build_app_refuses_what_engine_serve_refuses(tiny_serving_model):
    """Bad args stop the application before any replica starts, with engine-serve's own messages."""
    with pytest.raises(ValueError, match="need --enable-lora"):
        build_app({"model": tiny_serving_model, "lora-modules": "a=/nowhere"})
    with pytest.raises(ValueError, match="not engine-serve flags"):
        build_app({"model": tiny_serving_model, "no-such-flag": 1})
