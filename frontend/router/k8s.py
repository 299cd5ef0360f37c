"""`--service-discovery k8s`: the replicas are the pods matching a label selector in one namespace, listed and
then watched through the official `kubernetes` client (the `k8s` extra), as vLLM production-stack's router
finds its engines.

A pod is a replica while it is Running with an IP and not terminating (no deletionTimestamp: a pod being
deleted leaves before its SIGTERM drain ends); its URL is http://POD_IP:--k8s-port. Whether it takes requests
is still the pool's own /health probe (frontend/router/pool.py), so a pod joins once engine-serve is up, not
when Kubernetes schedules it.

The client is synchronous, so the list-and-watch loop runs in a daemon thread and hands each new set of URLs
to the event loop (`call_soon_threadsafe`). A watch that ends (its timeout, a 410 Gone, a dropped
connection) is followed by a fresh list: the set is always rebuilt from a full listing, never patched blind.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

WATCH_TIMEOUT_S = 300       # the API server ends a watch after this; the loop lists and watches again
RETRY_S = 2.0               # after an error talking to the API server


def pod_url(pod: Any, port: int) -> str | None:
    """The replica URL of a pod (a kubernetes.client.V1Pod), None while it is not one."""
    status, meta = pod.status, pod.metadata
    if meta.deletion_timestamp is not None or status is None or status.phase != "Running" or not status.pod_ip:
        return None
    host = f"[{status.pod_ip}]" if ":" in status.pod_ip else status.pod_ip
    return f"http://{host}:{port}"


def load_client_config() -> None:
    """In a pod, its service account; elsewhere the kubeconfig ($KUBECONFIG, else ~/.kube/config)."""
    from kubernetes import config
    try:
        config.load_incluster_config()
    except config.ConfigException:
        config.load_kube_config()


class K8sDiscovery:
    def __init__(self, namespace: str, label_selector: str, port: int,
                 on_urls: Callable[[set[str]], None], loop: asyncio.AbstractEventLoop) -> None:
        self.namespace, self.label_selector, self.port = namespace, label_selector, port
        self.on_urls, self.loop = on_urls, loop
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, name="k8s-discovery", daemon=True)
        self._watch: Any = None

    def start(self) -> None:
        try:
            import kubernetes  # noqa: F401
        except ImportError as exc:
            raise RuntimeError("--service-discovery k8s needs the kubernetes client: "
                               "pip install 'pagedserve[k8s]'") from exc
        load_client_config()
        self._thread.start()

    def stop(self) -> None:
        self._stopped.set()
        if self._watch is not None:
            self._watch.stop()

    def _run(self) -> None:
        from kubernetes import client
        api = client.CoreV1Api()
        while not self._stopped.is_set():
            try:
                self._list_and_watch(api)
            except Exception as exc:        # noqa: BLE001 - ApiException, urllib3's errors: list again shortly
                logger.warning("k8s discovery: %s: %s; listing again in %.0f s", type(exc).__name__, exc, RETRY_S)
                self._stopped.wait(RETRY_S)

    def _list_and_watch(self, api: Any) -> None:
        from kubernetes import watch
        listing = api.list_namespaced_pod(self.namespace, label_selector=self.label_selector)
        urls = {pod.metadata.name: pod_url(pod, self.port) for pod in listing.items}
        self._publish(urls)
        self._watch = watch.Watch()
        for event in self._watch.stream(api.list_namespaced_pod, self.namespace,
                                        label_selector=self.label_selector,
                                        resource_version=listing.metadata.resource_version,
                                        timeout_seconds=WATCH_TIMEOUT_S):
            if self._stopped.is_set():
                return
            pod = event["object"]
            if event["type"] == "DELETED":
                urls.pop(pod.metadata.name, None)
            elif event["type"] in ("ADDED", "MODIFIED"):
                urls[pod.metadata.name] = pod_url(pod, self.port)
            else:       # ERROR (an expired resourceVersion, ...) or BOOKMARK: list afresh
                return
            self._publish(urls)

    def _publish(self, urls: dict[str, str | None]) -> None:
        found = {url for url in urls.values() if url is not None}
        self.loop.call_soon_threadsafe(self.on_urls, found)
