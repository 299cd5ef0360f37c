"""vLLM's development routes for RL trainers (issue 30), on a real server: only with VLLM_SERVER_DEV_MODE=1,
behind --api-key; sleep refuses new requests with 503 and wake_up serves the same answers again."""
from __future__ import annotations

import httpx
import pytest
from fastapi import FastAPI

from pagedserve.frontend.rl.dev_routes import add_dev_routes
from pagedserve.tests.helpers.processes.server import Server
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model, random_prompts

ROUTES = {"/sleep", "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/collective_rpc"}
PROMPT = random_prompts(11, [24], vocab=512)[0]


def test_no_dev_routes_without_dev_mode(monkeypatch) -> None:
    monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    app = FastAPI()
    add_dev_routes(app, engine=None)
    assert not ROUTES & {route.path for route in app.routes}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = make_tiny_model(str(tmp_path_factory.mktemp("dev") / "m"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")
        srv = Server("--enable-sleep-mode", model=model, max_model_len=256)
    yield srv
    srv.stop()


def _complete(server: Server) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/completions", headers=server.auth, timeout=60,
                      json={"model": server_model(server), "prompt": PROMPT, "max_tokens": 5, "temperature": 0})


def server_model(server: Server) -> str:
    return httpx.get(f"{server.url}/v1/models", headers=server.auth).json()["data"][0]["id"]


def test_dev_routes_sleep_wake_rpc(server: Server) -> None:
    url, auth = server.url, server.auth
    assert httpx.get(f"{url}/is_sleeping").status_code == 401             # --api-key guards them too
    before = _complete(server).json()["choices"][0]["text"]
    assert httpx.post(f"{url}/sleep", params={"level": 1}, headers=auth, timeout=60).status_code == 200
    assert httpx.get(f"{url}/is_sleeping", headers=auth).json() == {"is_sleeping": True}
    asleep = _complete(server)
    assert asleep.status_code == 503 and "sleeping" in asleep.json()["error"]["message"]
    assert httpx.post(f"{url}/wake_up", params={"tags": ["kv_cache", "weights"]}, headers=auth,
                      timeout=60).status_code == 200
    assert httpx.get(f"{url}/is_sleeping", headers=auth).json() == {"is_sleeping": False}
    assert _complete(server).json()["choices"][0]["text"] == before
    assert httpx.post(f"{url}/reset_prefix_cache", headers=auth).status_code == 200
    rpc = httpx.post(f"{url}/collective_rpc", headers=auth, json={"method": "ping"}, timeout=60)
    assert rpc.json() == {"results": ["pong"]}
    bad = httpx.post(f"{url}/collective_rpc", headers=auth, json={"method": "no_such_method"}, timeout=60)
    assert bad.status_code == 400 and "no_such_method" in bad.json()["error"]["message"]
    bad = httpx.post(f"{url}/sleep", params={"level": 3}, headers=auth)
    assert bad.status_code == 400


def test_dev_routes_act_on_every_data_parallel_engine(tmp_path) -> None:
    """With two engines, sleep/wake_up reach both (is_sleeping is true only when both sleep, and no request is
    served while they do) and collective_rpc answers with every engine's ranks, engine after engine."""
    model = make_tiny_model(str(tmp_path / "m"))
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("VLLM_SERVER_DEV_MODE", "1")
        server = Server("--enable-sleep-mode", "--data-parallel-size", "2", "--data-parallel-routing", "least-loaded",
                        "--worker-extension-cls", "pagedserve.tests.helpers.rl.rl_extension.Probe", model=model,
                        max_model_len=256, token=None)
    try:
        url, auth = server.url, server.auth
        rpc = httpx.post(f"{url}/collective_rpc", headers=auth, timeout=60,
                         json={"method": "describe_rank", "kwargs": {"tag": "dp"}})
        assert rpc.json() == {"results": [{"rank": 0, "tp_rank": 0, "rows": 128, "tag": "dp"}] * 2}
        before = [_complete(server).json()["choices"][0]["text"] for _ in range(2)]     # one on each engine
        assert httpx.post(f"{url}/sleep", params={"level": 1}, headers=auth, timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", headers=auth).json() == {"is_sleeping": True}
        assert [_complete(server).status_code for _ in range(2)] == [503, 503]         # least-loaded: both
        assert httpx.post(f"{url}/wake_up", params={"tags": ["weights"]}, headers=auth, timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", headers=auth).json() == {"is_sleeping": True}   # KV still asleep
        assert httpx.post(f"{url}/wake_up", headers=auth, timeout=60).status_code == 200
        assert httpx.get(f"{url}/is_sleeping", headers=auth).json() == {"is_sleeping": False}
        assert [_complete(server).json()["choices"][0]["text"] for _ in range(2)] == before
        assert httpx.post(f"{url}/reset_prefix_cache", headers=auth).status_code == 200
    finally:
        server.stop()
