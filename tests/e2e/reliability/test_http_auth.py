"""--api-key protects every route the server has (found from its own spec, so a new route cannot slip
through) except the probes and the API description: /health, /metrics, /version, /openapi.json, docs."""
from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.timeout(300)

from pagedserve.frontend.api_server import OPEN_PATHS


def _routes(url: str) -> list[tuple[str, str]]:
    """(method, path) of every operation the running server publishes."""
    spec = httpx.get(f"{url}/openapi.json", timeout=10).json()
    return [(method.upper(), path) for path, ops in spec["paths"].items() for method in ops]


@pytest.mark.parametrize("auth", [None, "Bearer wrong-key", "Bearer", "reliability-key", "Basic cmVsaWFiaWxpdHk="])
def test_every_route_needs_the_key(api_server, auth):
    routes = [r for r in _routes(api_server.url) if r[1] not in OPEN_PATHS]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= {p for _, p in routes}
    headers = {"Authorization": auth} if auth is not None else {}
    for method, path in routes:
        resp = httpx.request(method, f"{api_server.url}{path}", headers=headers, json={"prompt": "x"}, timeout=30)
        assert resp.status_code == 401, f"{method} {path} answered {resp.status_code} without the key"
        error = resp.json()["error"]
        assert error["type"] == "authentication_error" and error["code"] == 401 and error["message"]
    # Paths that do not exist are refused too: the check runs before routing, on everything not open.
    assert httpx.post(f"{api_server.url}/v1/embeddings", headers=headers, json={}).status_code == 401


# POST /drain with the key would drain the server these tests share: tests/e2e/test_router.py opens it.
_SHARED_SERVER_ENDS = {("POST", "/drain")}


def test_the_right_key_opens_every_route(api_server):
    for method, path in _routes(api_server.url):
        if path not in OPEN_PATHS and (method, path) not in _SHARED_SERVER_ENDS:
            resp = httpx.request(method, f"{api_server.url}{path}", headers=api_server.auth,
                                 json={"prompt": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
                                 if method == "POST" else None, timeout=60)
            assert resp.status_code != 401, (method, path)


def test_health_and_metrics_stay_open(api_server):
    assert {"/health", "/metrics"} <= {path for _, path in _routes(api_server.url)}
    assert httpx.get(f"{api_server.url}/health", timeout=10).status_code == 200
    assert "vllm:num_requests_running" in httpx.get(f"{api_server.url}/metrics", timeout=10).text
