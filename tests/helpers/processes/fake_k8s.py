"""A small real Kubernetes API server for the router's discovery tests: a threaded HTTP server on a free
loopback port that serves what the official `kubernetes` client calls to list and watch pods
(GET /api/v1/namespaces/NS/pods, with labelSelector, and with watch=true as a stream of JSON-line events from a
resourceVersion), over pods the test puts and deletes; and the kubeconfig that points the client at it."""
from __future__ import annotations

import json
import os
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml


def _matches(labels: dict[str, str], selector: str) -> bool:
    """Equality-based label selectors (a=b,c=d), the only kind the router is given in these tests."""
    pairs = [p.split("=", 1) for p in selector.split(",") if p]
    return all(labels.get(k) == v for k, v in pairs)


class FakeKubeApi:
    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._pods: dict[str, dict[str, Any]] = {}
        self._events: list[tuple[int, str, dict[str, Any]]] = []      # (resourceVersion, type, pod)
        self._version = 1
        self._changed = threading.Condition()
        self._closing = False
        self._watch_generation = 0          # bumped to end every open watch (as an API server restart would)
        self.lists = 0
        self.watches = 0
        self.selectors: set[str] = set()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def kubeconfig(self, folder: str) -> str:
        path = os.path.join(folder, "kubeconfig")
        config = {"apiVersion": "v1", "kind": "Config", "current-context": "fake",
                  "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                  "users": [{"name": "fake", "user": {"token": "fake-token"}}],
                  "contexts": [{"name": "fake", "context": {"cluster": "fake", "user": "fake",
                                                            "namespace": self.namespace}}]}
        with open(path, "w") as f:
            yaml.safe_dump(config, f)
        return path

    def put(self, name: str, labels: dict[str, str], phase: str, ip: str | None, deleting: bool = False) -> None:
        """Create or update a pod (ADDED or MODIFIED)."""
        with self._changed:
            kind = "MODIFIED" if name in self._pods else "ADDED"
            self._version += 1
            metadata: dict[str, Any] = {"name": name, "namespace": self.namespace, "labels": labels,
                                        "resourceVersion": str(self._version), "uid": f"uid-{name}"}
            if deleting:
                metadata["deletionTimestamp"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
            status: dict[str, Any] = {"phase": phase, **({"podIP": ip} if ip else {})}
            pod = {"apiVersion": "v1", "kind": "Pod", "metadata": metadata, "spec": {"containers": []},
                   "status": status}
            self._pods[name] = pod
            self._events.append((self._version, kind, pod))
            self._changed.notify_all()

    def delete(self, name: str) -> None:
        with self._changed:
            self._version += 1
            pod = self._pods.pop(name)
            self._events.append((self._version, "DELETED", pod))
            self._changed.notify_all()

    def end_watches(self) -> None:
        """Close every open watch: the client must list and watch again to see later changes."""
        with self._changed:
            self._watch_generation += 1
            self._changed.notify_all()

    def close(self) -> None:
        with self._changed:
            self._closing = True
            self._changed.notify_all()
        self.server.shutdown()
        self.server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(parts.query).items()}
                if parts.path != f"/api/v1/namespaces/{api.namespace}/pods":
                    return self._json(404, {"kind": "Status", "apiVersion": "v1", "status": "Failure",
                                            "reason": "NotFound", "code": 404})
                selector = query.get("labelSelector", "")
                api.selectors.add(selector)
                if query.get("watch", "").lower() in ("true", "1"):
                    return self._watch(selector, int(query.get("resourceVersion") or 0),
                                       float(query.get("timeoutSeconds") or 300))
                with api._changed:
                    api.lists += 1
                    items = [p for p in api._pods.values() if _matches(p["metadata"]["labels"], selector)]
                    body = {"kind": "PodList", "apiVersion": "v1", "items": items,
                            "metadata": {"resourceVersion": str(api._version)}}
                self._json(200, body)

            def _watch(self, selector: str, since: int, timeout_s: float) -> None:
                # Chunked, as a real API server streams a watch: urllib3 hands the client each chunk as it comes.
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("transfer-encoding", "chunked")
                self.send_header("connection", "close")
                self.end_headers()
                deadline = time.monotonic() + timeout_s
                with api._changed:
                    api.watches += 1
                    generation = api._watch_generation
                    while not api._closing and generation == api._watch_generation:
                        fresh = [(v, k, p) for v, k, p in api._events if v > since]
                        for version, kind, pod in fresh:
                            since = version
                            if _matches(pod["metadata"]["labels"], selector):
                                self._chunk(json.dumps({"type": kind, "object": pod}).encode() + b"\n")
                        left = deadline - time.monotonic()
                        if left <= 0:
                            break
                        api._changed.wait(left)
                self._chunk(b"")

            def _chunk(self, data: bytes) -> None:
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            def _json(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        return Handler
