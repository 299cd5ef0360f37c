"""The Kubernetes examples in docs/deploy, which cannot run here (no Kubernetes): each is checked against its
CRD's published schema (tests/data/k8s, from KubeRay and LeaderWorkerSet), strictly as `kubectl apply
--validate=strict` would (an unknown field fails), and the pagedserve command lines in them parse with
engine-serve's own parser."""
from __future__ import annotations

import copy
import gzip
import importlib
import json
import os
import shlex
from typing import Any

import jsonschema
import pytest
import yaml

from pagedserve.frontend.cli import parse_args
from pagedserve.frontend.ray_serve import build_app, flags_from_args

HERE = os.path.dirname(__file__)
DEPLOY = os.path.join(HERE, "..", "..", "..", "docs", "deploy")
SCHEMAS = os.path.join(HERE, "..", "..", "data", "k8s")


def _schema(name: str) -> dict[str, Any]:
    with gzip.open(os.path.join(SCHEMAS, f"{name}.schema.json.gz")) as f:
        return json.load(f)


def _strict(node: Any) -> Any:
    """The schema with unknown fields refused wherever Kubernetes would prune them silently."""
    if isinstance(node, list):
        return [_strict(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {k: _strict(v) for k, v in node.items()}
    if ("properties" in out and "additionalProperties" not in out
            and not out.get("x-kubernetes-preserve-unknown-fields")):
        out["additionalProperties"] = False
    return out


def _validate(doc: dict[str, Any], crd: dict[str, Any]) -> None:
    assert doc["apiVersion"] == f"{crd['group']}/{crd['version']}" and doc["kind"] == crd["kind"]
    jsonschema.Draft7Validator(_strict(crd["openAPIV3Schema"])).validate(doc)


def _docs(name: str) -> list[dict[str, Any]]:
    with open(os.path.join(DEPLOY, name)) as f:
        return [d for d in yaml.safe_load_all(f) if d]


def test_rayservice_matches_kuberay_schema_and_engine_flags():
    (service,) = _docs("kuberay-rayservice.yaml")
    _validate(service, _schema("rayservice"))
    (app,) = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"]
    module, _, name = app["import_path"].partition(":")
    assert callable(getattr(importlib.import_module(module), name))
    args, server = parse_args(flags_from_args(app["args"]))
    assert (args.tensor_parallel_size, args.distributed_executor_backend) == (2, "ray")
    args.validate()
    assert [d["name"] for d in app["deployments"]] == ["PagedServe"]      # the deployment build_app makes


def test_leaderworkerset_matches_lws_schema_and_engine_flags():
    lws, service = _docs("lws.yaml")
    _validate(lws, _schema("leaderworkerset"))
    leader = lws["spec"]["leaderWorkerTemplate"]["leaderTemplate"]["spec"]["containers"][0]
    script = leader["command"][-1]
    words = shlex.split(script[script.index("engine-serve"):])
    args, server = parse_args(words[1:])
    args.validate()
    assert (args.tensor_parallel_size, args.pipeline_parallel_size, args.distributed_executor_backend) == (8, 2, "ray")
    assert server.port == leader["ports"][0]["containerPort"] == service["spec"]["ports"][0]["targetPort"]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] * 8 == args.tensor_parallel_size * args.pipeline_parallel_size


def test_strict_check_catches_a_misspelt_field():
    """The check can fail: a typo that Kubernetes would prune silently is an error here."""
    (service,) = _docs("kuberay-rayservice.yaml")
    bad = copy.deepcopy(service)
    bad["spec"]["rayClusterConfig"]["workerGroupSpecs"][0]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        _validate(bad, _schema("rayservice"))
    lws = copy.deepcopy(_docs("lws.yaml")[0])
    lws["spec"]["leaderWorkerTemplate"]["workerTemplate"]["spec"]["containers"][0]["comand"] = ["sh"]
    with pytest.raises(jsonschema.ValidationError, match="comand"):
        _validate(lws, _schema("leaderworkerset"))
    with pytest.raises(ValueError, match="not engine-serve flags: m --tensor-paralel-size 2"):
        build_app({"model": "m", "tensor-paralel-size": 2})
