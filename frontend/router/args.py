"""`pagedserve router`'s settings; each field is also a flag (common/config/arg_utils.py)."""
from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlsplit

from pagedserve.common.config.arg_utils import check_choices, setting
from pagedserve.frontend.router.lora import parse_lora_modules
from pagedserve.frontend.server_args import LOG_LEVELS

ROUTING_LOGICS = ("roundrobin", "least-load", "prefix", "session", "lora")
SERVICE_DISCOVERY = ("static", "k8s")


@dataclass(frozen=True)
class RouterArgs:
    """Made with bad values it raises ValueError naming the flag."""
    host: str = setting("127.0.0.1", help="address the router listens on")
    port: int = setting(8000, help="port the router listens on")
    service_discovery: str = setting(
        "static", choices=SERVICE_DISCOVERY,
        help="where the replicas come from: static (--backend); k8s (the pods matching --k8s-label-selector in "
             "--k8s-namespace, listed and watched through the Kubernetes API: a running pod joins once its "
             "/health probe passes, a deleted or terminating one leaves)")
    backend: tuple[str, ...] = setting(
        (), append=True, help="a replica's base URL (http://HOST:PORT, an engine-serve or any OpenAI-compatible "
                              "server); repeat the flag for each replica (service-discovery static)")
    dynamic_config_json: str | None = setting(
        None, help="service-discovery static: the replicas from this JSON file instead of --backend, re-read "
                   "when it changes (production-stack's shape: {\"static_backends\": \"http://a:8000,"
                   "http://b:8000\"}); a version that is not valid is logged and the last good one kept")
    k8s_namespace: str = setting("default", help="service-discovery k8s: the namespace whose pods are watched")
    k8s_label_selector: str = setting(
        "", help="service-discovery k8s: the replicas' pods, as a Kubernetes label selector "
                 "(app.kubernetes.io/component=replica,app.kubernetes.io/name=pagedserve)")
    k8s_port: int = setting(8000, help="service-discovery k8s: the port engine-serve listens on in each pod")
    backend_api_key: tuple[str, ...] = setting(
        (), append=True, help="the API key the router presents to the replicas: once for all of them, or once "
                              "per --backend in the same order (unset: the client's Authorization passes through "
                              "when the router has no --api-key)")
    api_key: str | None = setting(
        None, help="require 'Authorization: Bearer KEY' of clients on every route but /health, /metrics and "
                   "/version")
    routing_logic: str = setting(
        "roundrobin", choices=ROUTING_LOGICS,
        help="where a request goes among the healthy replicas serving its model: roundrobin; least-load (the "
             "replicas' vllm:num_requests_running + waiting, scraped each --health-check-interval); prefix (the "
             "replica this router sent the longest prefix of the prompt to, unless clearly busier than the "
             "least loaded); session (the same replica for the same --session-key header or body 'user'); lora (the "
             "least loaded replica with the request's adapter loaded, loading it on one when none has)")
    lora_modules: tuple[str, ...] = setting(
        (), append="+", help="routing-logic lora: NAME=PATH adapters the router may load on a replica "
                             "(POST /v1/load_lora_adapter) when none has NAME loaded; an adapter a replica "
                             "lists is loaded from the path it lists")
    session_key: str = setting("x-session-id", help="routing-logic session: the header that names a session; "
                                                    "without it, the body's 'user' field")
    health_check_interval: float = setting(
        2.0, help="seconds between probes of every replica's /health, /v1/models and /metrics; a dead or "
                  "draining replica leaves the pool within one interval and returns once healthy")
    max_retries: int = setting(
        2, help="other replicas a request is tried on when one fails before its first byte (refused, reset, "
                "503, 429)")
    prefix_block_chars: int = setting(
        64, help="routing-logic prefix: the prompt is hashed in blocks of this many characters (token ids for "
                 "a prompt given as ids)")
    request_timeout: float = setting(
        600.0, help="seconds a replica may take to connect or stay silent mid-response before the request fails")
    max_body_bytes: int = setting(8 << 20, help="larger request bodies get HTTP 413")
    log_level: str = setting("info", choices=LOG_LEVELS, help="log messages of this level and above")

    def __post_init__(self) -> None:
        for name in ("backend", "backend_api_key", "lora_modules"):
            if isinstance(getattr(self, name), list):       # RouterArgs(...) from Python code
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        check_choices(self, as_flags=True)
        self._validate_discovery()
        parse_lora_modules(self.lora_modules)
        for url in self.backend:
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.netloc:
                raise ValueError(f"--backend must be an http(s)://HOST:PORT URL, got {url!r}")
        if (self.service_discovery != "static" or self.dynamic_config_json) and len(self.backend_api_key) > 1:
            raise ValueError("give --backend-api-key once with --service-discovery k8s or --dynamic-config-json: "
                             "the replicas come and go")
        if len(self.backend_api_key) not in (0, 1, len(self.backend)):
            raise ValueError(f"give --backend-api-key once, or once per --backend ({len(self.backend)}), got "
                             f"{len(self.backend_api_key)}")
        for flag, port in (("--port", self.port), ("--k8s-port", self.k8s_port)):
            if not 0 <= port <= 65535:
                raise ValueError(f"{flag} must be in [0, 65535], got {port}")
        for flag, value in (("--health-check-interval", self.health_check_interval),
                            ("--request-timeout", self.request_timeout)):
            if not value > 0:
                raise ValueError(f"{flag} must be positive, got {value}")
        for flag, value in (("--prefix-block-chars", self.prefix_block_chars),
                            ("--max-body-bytes", self.max_body_bytes)):
            if value <= 0:
                raise ValueError(f"{flag} must be a positive integer, got {value}")
        if self.max_retries < 0:
            raise ValueError(f"--max-retries must be >= 0, got {self.max_retries}")

    def _validate_discovery(self) -> None:
        if self.service_discovery == "static" and not self.backend and not self.dynamic_config_json:
            raise ValueError("give at least one --backend URL (or --dynamic-config-json, or --service-discovery "
                             "k8s)")
        if self.dynamic_config_json is not None and (self.backend or self.service_discovery != "static"):
            raise ValueError("--dynamic-config-json lists the replicas itself: not with --backend or "
                             "--service-discovery k8s")
        if self.service_discovery == "k8s":
            if self.backend:
                raise ValueError("--backend is for --service-discovery static; k8s finds the replicas itself")
            # An empty selector matches every pod in the namespace, the routers' own among them.
            if not self.k8s_label_selector.strip():
                raise ValueError("--service-discovery k8s needs a --k8s-label-selector naming the replicas' pods")
            if not self.k8s_namespace:
                raise ValueError("--k8s-namespace must not be empty")

    def key_for(self, index: int) -> str | None:
        """The API key towards replica `index`."""
        if not self.backend_api_key:
            return None
        return self.backend_api_key[0 if len(self.backend_api_key) == 1 else index]
