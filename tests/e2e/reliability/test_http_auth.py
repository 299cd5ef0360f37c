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


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong-key"}, {"Authorization": "Bearer"},
                                     {"Authorization": "reliability-key"}, {"Authorization": "Basic cmVsaWFiaWxpdHk="},
                                     {"x-api-key": "wrong-key"}, {"x-api-key": "Bearer test-key-123"}])
def test_every_route_needs_the_key(api_server, headers):
    routes = [r for r in _routes(api_server.url) if r[1] not in OPEN_PATHS]
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/tokenize"} <= {p for _, p in routes}
    for method, path in routes:
        resp = httpx.request(method, f"{api_server.url}{path}", headers=headers, json={"prompt": "x"}, timeout=30)
        assert resp.status_code == 401, f"{method} {path} answered {resp.status_code} without the key"
        body = resp.json()
        error = body["error"]
        if path.startswith("/v1/messages"):       # Anthropic's error shape
            assert body["type"] == "error" and error["type"] == "authentication_error" and error["message"]
        else:
            assert error["type"] == "authentication_error" and error["code"] == 401 and error["message"]
    # Paths that do not exist are refused too: the check runs before routing, on everything not open.
    assert httpx.post(f"{api_server.url}/v1/embeddings", headers=headers, json={}).status_code == 401


@pytest.mark.parametrize("how", ["bearer", "x-api-key"])
def test_the_right_key_opens_every_route(api_server, how):
    """Authorization: Bearer KEY, or x-api-key: KEY as Anthropic's clients send it, on every route."""
    headers = api_server.auth if how == "bearer" else {"x-api-key": api_server.api_key}
    for method, path in _routes(api_server.url):
        # POST /drain with the key drains the shared server (tests/e2e/fleet/test_router.py sends it).
        if path not in OPEN_PATHS and path != "/drain":
            resp = httpx.request(method, f"{api_server.url}{path}", headers=headers,
                                 json={"prompt": "x", "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
                                 if method == "POST" else None, timeout=60)
            assert resp.status_code != 401, (method, path)


def test_health_and_metrics_stay_open(api_server):
    assert {"/health", "/metrics"} <= {path for _, path in _routes(api_server.url)}
    assert httpx.get(f"{api_server.url}/health", timeout=10).status_code == 200
    assert "vllm:num_requests_running" in httpx.get(f"{api_server.url}/metrics", timeout=10).text
