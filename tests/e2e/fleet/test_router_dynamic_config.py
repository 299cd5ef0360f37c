"""`pagedserve router --dynamic-config-json FILE`: the replicas from a JSON file (production-stack's shape),
re-read when it changes, over real HTTP upstreams (tests/helpers/processes/router.py's StaticUpstream, each listing its
own model, so the router's /v1/models union says which are in the pool). No engine: about 10 s."""
from __future__ import annotations

import json
import os

import httpx
import pytest

from pagedserve.frontend.router.args import RouterArgs
from pagedserve.frontend.router.dynamic_config import parse_config
from pagedserve.tests.helpers.processes.router import Router, StaticUpstream, wait_for

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def upstreams():
    pair = [StaticUpstream("model-a", 200, 0), StaticUpstream("model-b", 200, 0)]
    yield pair
    for upstream in pair:
        upstream.close()


def _write(path: str, config: dict | str) -> None:
    """Atomically, as a ConfigMap volume swaps its files."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(config if isinstance(config, str) else json.dumps(config))
    os.replace(tmp, path)


def _models(router: Router) -> list[str]:
    return sorted(m.id for m in router.client().models.list().data)


def test_the_pool_follows_the_file(upstreams, tmp_path):
    a, b = upstreams
    path = str(tmp_path / "router.json")
    _write(path, {"service_discovery": "static", "routing_logic": "roundrobin", "static_backends": a.url})
    router = Router(extra=("--dynamic-config-json", path), healthy=1)
    try:
        assert _models(router) == ["model-a"]
        _write(path, {"static_backends": f"{a.url},{b.url}"})
        wait_for(lambda: _models(router) == ["model-a", "model-b"], 30, "b to join")
        answer = httpx.post(f"{router.url}/v1/completions", headers=router.auth,
                            json={"model": "model-b", "prompt": "x"}, timeout=10)
        assert answer.status_code == 200

        _write(path, "{not json")                                       # ignored: the last good list stays
        wait_for(lambda: "ignored: not JSON" in router.output(), 30, "the bad version to be logged")
        _write(path, {"static_backends": [b.url], "routing_logic": "prefix"})   # ignored too: not its logic
        wait_for(lambda: "routing_logic must stay 'roundrobin'" in router.output(), 30, "the refusal")
        assert _models(router) == ["model-a", "model-b"] and router.health()["replicas"] == 2

        _write(path, {"static_backends": [b.url]})
        wait_for(lambda: router.health()["replicas"] == 1, 30, "a to leave")
        assert _models(router) == ["model-b"]
        gone = httpx.post(f"{router.url}/v1/completions", headers=router.auth,
                          json={"model": "model-a", "prompt": "x"}, timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["param"] == "model"
    finally:
        router.stop()


def test_a_bad_file_at_start_stops_the_router_naming_it(tmp_path):
    path = str(tmp_path / "router.json")
    _write(path, {"static_backends": "ftp://nope"})
    with pytest.raises(RuntimeError, match="--dynamic-config-json .*'ftp://nope' is not an http"):
        Router(extra=("--dynamic-config-json", path), healthy=1)


def test_the_file_and_flags_are_checked():
    with pytest.raises(ValueError, match="unknown fields \\['static_backend'\\]"):
        parse_config('{"static_backend": "http://a:1"}', "roundrobin")
    with pytest.raises(ValueError, match="service_discovery must be 'static'"):
        parse_config('{"service_discovery": "k8s", "static_backends": ""}', "roundrobin")
    assert parse_config('{"static_backends": "http://a:1/, http://b:2"}', "session") == {"http://a:1",
                                                                                       "http://b:2"}
    with pytest.raises(ValueError, match="not with --backend"):
        RouterArgs(dynamic_config_json="f.json", backend=("http://a:1",))
