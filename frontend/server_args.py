"""The HTTP server's own settings (the engine's are EngineArgs); each field is also an engine-serve flag."""
from __future__ import annotations

import os
from dataclasses import dataclass

from pagedserve.common.config.arg_utils import check_choices, setting
from pagedserve.frontend.dp.router import ROUTING_POLICIES
from pagedserve.frontend.parsers.tool_parsers import TOOL_PARSERS
from pagedserve.frontend.tracing.settings import DETAILED_TRACES, check_tracing

DATA_PARALLEL_BACKENDS = ("mp", "ray")
TOOL_PARSER_NAMES = tuple(TOOL_PARSERS)

LOG_LEVELS = ("debug", "info", "warning", "error")
UVICORN_LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


@dataclass(frozen=True)
class ServerArgs:
    """Made with bad values it raises ValueError naming the flag, so a ServerArgs in hand is valid."""
    host: str = setting("127.0.0.1", help="address the HTTP server listens on")
    port: int = setting(8000, help="port the HTTP server listens on")
    api_key: str | None = setting(
        env="PAGEDSERVE_API_KEY",
        help="require 'Authorization: Bearer KEY' (or 'x-api-key: KEY') on every route but /health, /metrics, "
             "/version and the API description; with none, no route needs a key")
    engine_address: str | None = setting(
        None, help="where other processes (AsyncEngineClient.connect) reach the engine core: ipc://PATH "
                   "(unset: a private path) or tcp://HOST:PORT (needs --engine-token; uses PORT and PORT+1)")
    engine_token: str | None = setting(
        env="PAGEDSERVE_ENGINE_TOKEN",
        help="secret clients must present to the engine core; with none, one is generated and written to a "
             "private file")
    chat_template: str | None = setting(
        None, help="chat template for /v1/chat/completions instead of the tokenizer's: a file or the Jinja "
                   "text itself")
    enable_auto_tool_choice: bool = setting(
        False, store_true=True, help="let tool_choice 'auto' requests call tools; the output is read with "
                                     "--tool-call-parser")
    enable_prompt_tokens_details: bool = setting(
        False, store_true=True, help="report usage.prompt_tokens_details.cached_tokens (the prompt's tokens "
                                     "read from the prefix cache) in chat and completions responses")
    tool_call_parser: str | None = setting(
        None, choices=TOOL_PARSER_NAMES, help="how the model writes tool calls, for tool_choice 'auto': hermes "
                                              "(Qwen2.5, Qwen3, Hermes), llama3_json (Llama 3.x), mistral")
    ssl_keyfile: str | None = setting(None, help="serve HTTPS with this private key (with --ssl-certfile)")
    ssl_certfile: str | None = setting(None, help="serve HTTPS with this certificate chain (with --ssl-keyfile)")
    max_body_bytes: int = setting(8 << 20, help="larger request bodies get HTTP 413; a larger image or video "
                                  "(fetched, read or inline) gets 400")
    max_concurrent_requests: int | None = setting(
        None, help="generation requests this server serves at once; beyond that HTTP 429 (unset: no bound)")
    data_parallel_routing: str = setting(
        "prefix", choices=ROUTING_POLICIES,
        help="with --data-parallel-size > 1, where a request goes: prefix (the engine holding the longest cached "
             "prefix of its prompt, unless clearly busier than the least loaded), least-loaded (queue length "
             "only, as vLLM)")
    data_parallel_backend: str = setting(
        "mp", choices=DATA_PARALLEL_BACKENDS,
        help="where data-parallel engine cores run: mp (processes on this node, or headless nodes that register), "
             "ray (each in a Ray placement group on RAY_ADDRESS's cluster, else a local one; pip install "
             "'pagedserve[ray]')")
    # Multi-node data parallelism, vLLM's flags (docs/operations.md#data-parallel-engines).
    data_parallel_size_local: int | None = setting(
        None, help="data-parallel engine cores started on this node (unset: all of --data-parallel-size); the "
                   "others register from headless nodes")
    data_parallel_start_rank: int = setting(0, help="--headless: the data-parallel rank of this node's first engine")
    data_parallel_address: str | None = setting(
        None, help="the head node's address, where headless nodes register their engine cores")
    data_parallel_rpc_port: int = setting(29550, help="the head's port for those registrations")
    headless: bool = setting(
        False, store_true=True, help="start --data-parallel-size-local engine cores and register them with the "
                                     "head at --data-parallel-address; serve no API here")
    enable_elastic_ep: bool = setting(
        False, store_true=True, help="let POST /scale_elastic_ep (or /scale) grow or shrink --data-parallel-size "
                                     "at run time without dropping requests; the routes need VLLM_SERVER_DEV_MODE=1 "
                                     "or --api-key. Engines on this node only (not with --headless or remote ranks)")
    restart_engine_on_failure: bool = setting(
        False, store_true=True, help="restart a dead engine core (and its workers), with back-off, instead of "
                                     "failing the server; a crash loop (4 deaths in 300 s) gives up. Data-parallel "
                                     "engines always restart while another serves")
    lora_modules: tuple[str, ...] = setting(
        (), append="+", help="with --enable-lora: adapters served from the start, each name=path or vLLM's JSON "
                             "{\"name\": ..., \"path\": ..., \"base_model_name\": ...}; a request's model "
                             "picks one by name")
    allow_runtime_lora_updating: bool = setting(
        False, store_true=True, help="serve POST /v1/load_lora_adapter and /v1/unload_lora_adapter (as vLLM's "
                                     "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True)")
    responses_store_max_entries: int = setting(
        1024, help="/v1/responses: responses kept for GET and previous_response_id (store: true); beyond that the "
                   "least recently used is dropped; 0 keeps none")
    responses_store_ttl: float = setting(
        3600.0, help="/v1/responses: seconds a stored response is kept after it was made")
    shutdown_timeout: float = setting(
        30.0, help="on SIGTERM or POST /drain: seconds in-flight requests may take to finish (new ones get 503 "
                   "with Retry-After and /health turns unready meanwhile) before the server exits")
    otlp_traces_endpoint: str | None = setting(
        env="OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
        help="send one OpenTelemetry span per request (vLLM's llm_request, gen_ai.* attributes) to this OTLP "
             "endpoint; OTEL_EXPORTER_OTLP_TRACES_PROTOCOL picks grpc (the default) or http/protobuf (pip "
             "install 'pagedserve[otel]')")
    collect_detailed_traces: str | None = setting(
        None, choices=DETAILED_TRACES,
        help="with --otlp-traces-endpoint: add the engine core's scheduling moments of each request (QUEUED, "
             "SCHEDULED, PREEMPTED) to its span as events, and the model's times summed over its steps: model "
             "the forward's (gen_ai.latency.time_in_model_forward), worker the executor's "
             "(gen_ai.latency.time_in_model_execute), all both")
    log_level: str = setting("info", choices=LOG_LEVELS, help="log messages of this level and above")
    root_path: str | None = setting(
        None, help="the path prefix a reverse proxy serves this server under (e.g. /llm): routes answer with "
                   "and without it, and the API description's links carry it")
    # CORS, with vLLM's flags and defaults (every origin, method and header; no credentials).
    allowed_origins: tuple[str, ...] = setting(("*",), help="CORS: origins browsers may call from, a JSON list")
    allowed_methods: tuple[str, ...] = setting(("*",), help="CORS: HTTP methods allowed, a JSON list")
    allowed_headers: tuple[str, ...] = setting(("*",), help="CORS: request headers allowed, a JSON list")
    allow_credentials: bool = setting(False, store_true=True, help="CORS: allow credentials (cookies, auth)")
    # Accepted so that vLLM launch scripts start pagedserve unchanged; they change nothing here.
    disable_log_requests: bool = setting(
        False, store_true=True, help="accepted for vLLM compatibility, no effect: pagedserve never logs "
                                     "individual requests")
    uvicorn_log_level: str | None = setting(
        None, choices=UVICORN_LOG_LEVELS, help="accepted for vLLM compatibility, no effect: the HTTP server "
                                               "logs at --log-level")

    def __post_init__(self) -> None:
        for name in ("allowed_origins", "allowed_methods", "allowed_headers"):
            if isinstance(getattr(self, name), list):       # ServerArgs(...) from Python code
                object.__setattr__(self, name, tuple(getattr(self, name)))
        self.validate()

    def validate(self) -> None:
        """ValueError, naming the flag, for values the server cannot start with."""
        from pagedserve.frontend.lora.serving import parse_lora_modules
        parse_lora_modules(self.lora_modules)
        check_choices(self, as_flags=True)
        if not 0 <= self.port <= 65535:
            raise ValueError(f"--port must be in [0, 65535], got {self.port}")
        if self.engine_address and self.engine_address.startswith("tcp://") and not self.engine_token:
            raise ValueError("a tcp:// --engine-address requires --engine-token (or PAGEDSERVE_ENGINE_TOKEN)")
        for flag, value in (("--max-body-bytes", self.max_body_bytes),
                            ("--max-concurrent-requests", self.max_concurrent_requests)):
            if value is not None and value <= 0:
                raise ValueError(f"{flag} must be a positive integer, got {value}")
        check_tracing(self.otlp_traces_endpoint, self.collect_detailed_traces)
        if self.responses_store_max_entries < 0:
            raise ValueError(f"--responses-store-max-entries must be >= 0, got {self.responses_store_max_entries}")
        if not self.shutdown_timeout >= 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {self.shutdown_timeout}")
        if not self.responses_store_ttl > 0:
            raise ValueError(f"--responses-store-ttl must be positive, got {self.responses_store_ttl}")
        if not 0 < self.data_parallel_rpc_port < 65536:
            raise ValueError(f"--data-parallel-rpc-port must be in [1, 65535], got {self.data_parallel_rpc_port}")
        if self.data_parallel_size_local is not None and self.data_parallel_size_local < 0:
            raise ValueError(f"--data-parallel-size-local must be >= 0, got {self.data_parallel_size_local}")
        if self.headless and not (self.data_parallel_address and self.engine_token):
            raise ValueError("--headless needs --data-parallel-address (the head) and --engine-token (shared "
                             "with the head)")
        if bool(self.ssl_keyfile) != bool(self.ssl_certfile):
            raise ValueError("HTTPS needs both --ssl-keyfile and --ssl-certfile")
        for flag, path in (("--ssl-keyfile", self.ssl_keyfile), ("--ssl-certfile", self.ssl_certfile)):
            if path and not os.path.isfile(path):
                raise ValueError(f"{flag} {path!r} is not a file")
        if self.root_path is not None and (not self.root_path.startswith("/") or self.root_path.endswith("/")):
            raise ValueError(f"--root-path must start with '/' and not end with one, got {self.root_path!r}")
        for flag, values in (("--allowed-origins", self.allowed_origins),
                             ("--allowed-methods", self.allowed_methods),
                             ("--allowed-headers", self.allowed_headers)):
            if not isinstance(values, tuple) or not all(isinstance(v, str) for v in values):
                raise ValueError(f"{flag} must be a list of strings, got {values!r}")
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            raise ValueError("--enable-auto-tool-choice requires --tool-call-parser")
