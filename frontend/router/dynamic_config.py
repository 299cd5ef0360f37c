"""`--dynamic-config-json FILE`: the replicas from a JSON file, re-read when it changes, in the shape of vLLM
production-stack's router dynamic config: {"service_discovery": "static", "routing_logic": "roundrobin",
"static_backends": "http://a:8000,http://b:8000"} (static_backends may also be a JSON list of URLs).

Only the replica list is reloaded; service_discovery and routing_logic, if given, must be what the router runs
with (changing them live is not supported). The file is polled (its bytes compared), not watched by inotify:
a Kubernetes ConfigMap volume swaps a symlink, which a poll sees and an inotify watch on the old file does not.
A version that does not parse or validate is logged and ignored: the pool keeps the last good list.
"""
from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from urllib.parse import urlsplit

logger = logging.getLogger(__name__)

POLL_S = 1.0
KNOWN_FIELDS = frozenset({"service_discovery", "routing_logic", "static_backends"})


def parse_config(text: str, routing_logic: str) -> set[str]:
    """The replica URLs a config file's text names; ValueError naming the field when it is not valid."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    if not isinstance(data, dict):
        raise ValueError("must be a JSON object")
    if unknown := sorted(set(data) - KNOWN_FIELDS):
        raise ValueError(f"unknown fields {unknown}; known: {sorted(KNOWN_FIELDS)}")
    if data.get("service_discovery", "static") != "static":
        raise ValueError(f"service_discovery must be 'static' here, got {data['service_discovery']!r}")
    if data.get("routing_logic", routing_logic) != routing_logic:
        raise ValueError(f"routing_logic must stay {routing_logic!r} (the router's --routing-logic), "
                         f"got {data['routing_logic']!r}")
    backends = data.get("static_backends")
    if isinstance(backends, str):
        backends = [u.strip() for u in backends.split(",") if u.strip()]
    if not isinstance(backends, list) or not all(isinstance(u, str) for u in backends):
        raise ValueError("static_backends must be a comma-separated string or a list of URLs")
    for url in backends:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise ValueError(f"static_backends: {url!r} is not an http(s)://HOST:PORT URL")
    return {u.rstrip("/") for u in backends}


class DynamicConfigFile:
    def __init__(self, path: str, routing_logic: str, on_urls: Callable[[set[str]], None]) -> None:
        self.path, self.routing_logic, self.on_urls = path, routing_logic, on_urls
        self._last: bytes | None = None

    def load(self) -> None:
        """The first read, at start-up: a missing or bad file stops the router (ValueError naming it)."""
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
            urls = parse_config(raw.decode(), self.routing_logic)
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise ValueError(f"--dynamic-config-json {self.path}: {exc}") from None
        self._last = raw
        self.on_urls(urls)

    async def run(self) -> None:
        """Poll forever (the app's lifespan cancels it)."""
        while True:
            await asyncio.sleep(POLL_S)
            self.reload()

    def reload(self) -> None:
        try:
            with open(self.path, "rb") as f:
                raw = f.read()
        except OSError as exc:          # mid-swap, or deleted: keep the last good list
            logger.warning("--dynamic-config-json %s: %s; keeping the replicas as they are", self.path, exc)
            return
        if raw == self._last:
            return
        self._last = raw
        try:
            urls = parse_config(raw.decode(errors="replace"), self.routing_logic)
        except ValueError as exc:
            logger.error("--dynamic-config-json %s ignored: %s; keeping the replicas as they are", self.path, exc)
            return
        logger.info("--dynamic-config-json %s changed: %d replicas", self.path, len(urls))
        self.on_urls(urls)
