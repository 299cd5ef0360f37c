"""`pagedserve router --service-discovery k8s`: the real `kubernetes` client in the router process, pointed by
a kubeconfig at a local fake API server (tests/helpers/processes/fake_k8s.py), lists and watches pods by label selector;
two real tiny-model engine-serve replicas stand for the pods, each on its own loopback address (the pod IP)
and the same port (--k8s-port). Which replica answered is read from the replicas' own request counters."""
from __future__ import annotations

import pytest

from pagedserve.frontend.router.args import RouterArgs
from pagedserve.tests.helpers.processes.fake_k8s import FakeKubeApi
from pagedserve.tests.helpers.processes.router import Router, wait_for
from pagedserve.tests.helpers.processes.server import API_KEY, SMALL_KV, Server, free_port_on

pytestmark = pytest.mark.timeout(600)

NAMESPACE = "serving"
LABELS = {"app.kubernetes.io/name": "pagedserve", "app.kubernetes.io/component": "replica"}
SELECTOR = ",".join(f"{k}={v}" for k, v in LABELS.items())
HOSTS = ["127.0.0.2", "127.0.0.3"]
DEAD_HOST = "127.0.0.4"         # a pod whose engine never came up: nothing listens there
DONE = "request_success_total"


@pytest.fixture(scope="module")
def pods(tiny_serving_model):
    port = free_port_on([*HOSTS, DEAD_HOST])
    servers = [Server(*SMALL_KV, "--max-num-seqs", "4", model=tiny_serving_model, max_model_len=256,
                      host=host, port=port) for host in HOSTS]
    yield port, servers
    for server in servers:
        server.stop()


def _sent_to(servers, router: Router, model: str, n: int) -> list[float]:
    """How many of n completions through the router each replica answered (its own vllm:request_success)."""
    before = [s.metrics()[DONE] for s in servers]
    client = router.client()
    for i in range(n):
        client.completions.create(model=model, prompt=f"hello {i}", max_tokens=2, temperature=0)
    wait_for(lambda: sum(s.metrics()[DONE] for s in servers) - sum(before) >= n, 60, "the replicas' counters")
    return [s.metrics()[DONE] - b for s, b in zip(servers, before)]


def _replicas_are(router: Router, healthy: int, listed: int) -> None:
    want = {"healthy_replicas": healthy, "replicas": listed}
    wait_for(lambda: {k: router.health().get(k) for k in want} == want, 60, f"the router's pool to be {want}")


def test_pods_join_and_leave_the_pool_as_the_api_server_says(pods, tmp_path):
    port, (a, b) = pods
    api = FakeKubeApi(NAMESPACE)
    api.put("replica-a", LABELS, "Running", HOSTS[0])
    api.put("replica-b", LABELS, "Pending", None)                      # scheduled, no IP yet: not a replica
    api.put("not-a-replica", {"app.kubernetes.io/name": "other"}, "Running", HOSTS[1])
    router = Router(routing="roundrobin", backend_key=API_KEY, healthy=1,
                    env={"KUBECONFIG": api.kubeconfig(str(tmp_path))},
                    extra=("--service-discovery", "k8s", "--k8s-namespace", NAMESPACE,
                           "--k8s-label-selector", SELECTOR, "--k8s-port", str(port)))
    try:
        model = router.client().models.list().data[0].id
        assert router.health()["replicas"] == 1                          # neither the pending nor the other pod
        assert api.selectors == {SELECTOR} and api.watches >= 1
        assert _sent_to([a, b], router, model, 4) == [4, 0]

        api.put("replica-b", LABELS, "Running", HOSTS[1])                # it got its IP: it joins
        _replicas_are(router, healthy=2, listed=2)
        assert _sent_to([a, b], router, model, 4) == [2, 2]

        api.put("replica-a", LABELS, "Running", HOSTS[0], deleting=True)  # terminating: it leaves at once
        _replicas_are(router, healthy=1, listed=1)
        assert _sent_to([a, b], router, model, 4) == [0, 4]
        gauge = 'pagedserve_router:replica_healthy{replica="%s"}'
        assert gauge % a.url not in router.metrics_text()                    # a gone replica's gauge goes too
        assert f"{gauge % b.url} 1.0" in router.metrics_text()

        api.delete("replica-a")
        api.put("replica-c", LABELS, "Running", DEAD_HOST)               # listed, but its probe never passes
        _replicas_are(router, healthy=1, listed=2)
        assert _sent_to([a, b], router, model, 3) == [0, 3]

        api.end_watches()                                                # the router lists and watches again
        api.delete("replica-c")
        _replicas_are(router, healthy=1, listed=1)
        assert api.lists >= 2
    finally:
        router.stop()
        api.close()


def test_discovery_flags_are_checked():
    with pytest.raises(ValueError, match="--k8s-label-selector"):
        RouterArgs(service_discovery="k8s")
    with pytest.raises(ValueError, match="--backend is for --service-discovery static"):
        RouterArgs(service_discovery="k8s", k8s_label_selector="a=b", backend=("http://x:1",))
    with pytest.raises(ValueError, match="--k8s-port"):
        RouterArgs(service_discovery="k8s", k8s_label_selector="a=b", k8s_port=70000)
    with pytest.raises(ValueError, match="--service-discovery must be one of static, k8s"):
        RouterArgs(service_discovery="dns", backend=("http://x:1",))
