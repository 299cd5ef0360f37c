"""Property-based fuzzing of the HTTP API from its own OpenAPI spec (schemathesis): never a 5xx.

Schemathesis generates bodies that match the spec (positive) and bodies that break it (negative) for every
operation of a real `engine-serve` on a tiny random model. Every answer must be a 2xx or a 4xx with an
OpenAI-shaped error (Anthropic-shaped on /v1/messages*), and the server must stay healthy. Only the fuzzer's copy of the spec is narrowed
(max_tokens, n, prompt sizes) so that generation stays short; the server validates exactly as in production.
"""
from __future__ import annotations

import copy
from typing import Any

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

pytestmark = pytest.mark.timeout(300)

# Generated bodies may ask for up to this many tokens (per sample) and samples.
_BOUNDS: dict[str, dict[str, Any]] = {
    "max_tokens": {"maximum": 8},
    "max_completion_tokens": {"maximum": 8},
    "max_output_tokens": {"maximum": 8},
    "min_tokens": {"maximum": 8},
    "n": {"maximum": 2},
}


# Fields the fuzzer always sends (bounded above): a Responses body without max_output_tokens generates up to
# max_model_len, ~1 s on the tiny model, where a chat or completions body without max_tokens is mostly refused
# for its other fields first. Their absence is the schemas' default and the other tests' common case.
_ALWAYS = ("max_output_tokens",)


def _narrowed(spec: dict[str, Any]) -> dict[str, Any]:
    """The spec with generation kept short: bounds on the token-count fields of every request schema."""
    spec = copy.deepcopy(spec)
    for schema in spec.get("components", {}).get("schemas", {}).values():
        present = [name for name in _ALWAYS if name in schema.get("properties", {})]
        if present:
            schema["required"] = sorted(set(schema.get("required", [])) | set(present))
        for name, prop in schema.get("properties", {}).items():
            if name in _BOUNDS:
                for variant in prop.get("anyOf", [prop]):
                    if variant.get("type") == "integer":
                        variant.update(_BOUNDS[name])
    return spec


@pytest.fixture(scope="module")
def api_schema(api_server):
    spec = httpx.get(f"{api_server.url}/openapi.json", timeout=10).json()
    schema = schemathesis.openapi.from_dict(_narrowed(spec))
    schema.config.update(base_url=api_server.url, headers=api_server.auth, request_timeout=60)
    return schema


# Every operation of the spec; test_spec_lists_every_operation fails when a route is added without fuzzing.
OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
              ("GET", "/health"), ("GET", "/metrics"), ("GET", "/version"), ("POST", "/tokenize"),
              ("POST", "/detokenize"), ("POST", "/v1/responses"), ("GET", "/v1/responses/{response_id}"),
              ("POST", "/v1/responses/{response_id}/cancel"),
              # pooling routes (frontend/pooling/serving.py): on this generating model each answers a 400
              ("POST", "/v1/embeddings"), ("POST", "/pooling"), ("POST", "/classify"), ("POST", "/score"),
              ("POST", "/v1/score"), ("POST", "/rerank"), ("POST", "/v1/rerank"), ("POST", "/v2/rerank"),
              # the Anthropic Messages API (frontend/anthropic/): its errors in Anthropic's shape
              ("POST", "/v1/messages"), ("POST", "/v1/messages/count_tokens")]
# POST operations whose input is their path alone.
_NO_BODY = {("POST", "/v1/responses/{response_id}/cancel")}
_EXAMPLES = {"POST": 60, "GET": 5}


# Operations the spec lists that are not fuzzed: POST /drain (served with --api-key) stops the server it is
# sent to; tests/e2e/fleet/test_router.py sends it. The elastic routes change or report the engine count (a
# server without --enable-elastic-ep answers 400); tests/e2e/fleet/test_elastic_dp.py sends them.
_NOT_FUZZED = {("POST", "/drain"), ("POST", "/scale"), ("POST", "/scale_elastic_ep"), ("POST", "/is_scaling_elastic_ep")}


def test_spec_lists_every_operation_and_body(api_server):
    spec = httpx.get(f"{api_server.url}/openapi.json", timeout=10).json()
    listed = {(method.upper(), path) for path, ops in spec["paths"].items() for method in ops}
    assert listed - _NOT_FUZZED == set(OPERATIONS)
    for method, path in OPERATIONS:
        # The bodies are described, so the fuzzer reaches real validation.
        if method == "POST" and (method, path) not in _NO_BODY:
            ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
            assert spec["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"], path


def _cases(api_schema, method: str, path: str) -> st.SearchStrategy:
    op = api_schema.find_operation_by_path(method, path)
    if method == "GET" or (method, path) in _NO_BODY:        # a path at most: nothing to break
        return op.as_strategy(GenerationMode.POSITIVE)
    return st.one_of(op.as_strategy(GenerationMode.POSITIVE), op.as_strategy(GenerationMode.NEGATIVE))


@pytest.mark.parametrize("method,path", OPERATIONS)
def test_no_server_errors(api_schema, api_server, method, path):
    @given(case=_cases(api_schema, method, path))
    @settings(max_examples=_EXAMPLES[method], deadline=None, suppress_health_check=list(HealthCheck),
              derandomize=True, database=None)
    def check(case) -> None:
        response = case.call(base_url=api_server.url, headers=api_server.auth, timeout=60)
        assert response.status_code < 500, (f"{case.method} {case.path} -> {response.status_code}: "
                                            f"{response.text[:500]}\nbody: {case.body!r}"[:2000])
        if response.status_code >= 400 and path.startswith("/v1/messages"):
            body = response.json()
            assert body["type"] == "error" and body["error"]["message"] and body["error"]["type"]
        elif response.status_code >= 400:
            error = response.json()["error"]
            assert error["message"] and error["type"] and error["code"] == response.status_code
    check()


_HUGE = 1 << 70      # past msgpack's 64-bit ints: once a 500 from the engine client's encoder


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "x", "seed": _HUGE}, "seed"),
    ("/v1/completions", {"prompt": "x", "seed": -_HUGE}, "seed"),
    ("/v1/completions", {"prompt": "x", "top_k": _HUGE}, "top_k"),
    ("/v1/completions", {"prompt": "x", "stop_token_ids": [_HUGE]}, "stop_token_ids"),
    ("/v1/completions", {"prompt": "x", "priority": _HUGE}, "priority"),
    ("/v1/completions", {"prompt": "x", "n": 100000}, "n"),
    ("/v1/chat/completions", {"messages": [{"role": ""}]}, "messages"),     # the template cannot render it
    ("/v1/chat/completions", {"messages": []}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}}, "chat_template_kwargs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("/tokenize", {"messages": [{"role": ""}]}, "messages"),
])
def test_hostile_values_are_400(api_server, path, body, param):
    """Values found by fuzzing and review that once answered 500 or reached past validation."""
    resp = httpx.post(f"{api_server.url}{path}", json={"max_tokens": 2, **body} if path != "/tokenize" else body,
                      headers=api_server.auth, timeout=60)
    assert resp.status_code == 400, resp.text
    assert param in (resp.json()["error"]["param"] or "") + resp.json()["error"]["message"]


def test_still_healthy_and_idle_after_fuzzing(api_server):
    assert httpx.get(f"{api_server.url}/health", timeout=10).status_code == 200
    m = api_server.wait_idle()
    assert (m["num_requests_running"], m["num_requests_waiting"], m["kv_cache_usage_perc"]) == (0, 0, 0)
