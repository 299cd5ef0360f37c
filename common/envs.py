"""Every environment variable pagedserve reads, parsed here and nowhere else (vLLM's `vllm.envs` shape).

`envs.PAGEDSERVE_X` reads the variable when it is asked for, not at import: a test or a launcher that
sets it before starting an engine is seen. A variable missing from this table is a typo, and an
AttributeError says so.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


def _cache_dir() -> str:
    return os.environ.get("PAGEDSERVE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "pagedserve")


def _float(name: str, default: float) -> Callable[[], float]:
    def read() -> float:
        raw = os.environ.get(name)
        if raw is None or raw == "":
            return default
        try:
            return float(raw)
        except ValueError:
            raise ValueError(f"environment variable {name} must be a number, got {raw!r}") from None
    return read


def _choice(name: str, default: str, allowed: tuple[str, ...]) -> Callable[[], str]:
    def read() -> str:
        value = os.environ.get(name) or default
        if value not in allowed:
            raise ValueError(f"environment variable {name} must be one of {', '.join(allowed)}, got {value!r}")
        return value
    return read


environment_variables: dict[str, Callable[[], Any]] = {
    # Where converted GGUF tokenizers and the built C kernels are cached.
    "PAGEDSERVE_CACHE_DIR": _cache_dir,
    # The folder private ipc:// socket folders are made in (unset: the system's temp folder).
    "PAGEDSERVE_IPC_ROOT": lambda: os.environ.get("PAGEDSERVE_IPC_ROOT") or None,
    # Seconds an engine core or a worker may take to load before its starter gives up.
    "PAGEDSERVE_STARTUP_TIMEOUT": _float("PAGEDSERVE_STARTUP_TIMEOUT", 900.0),
    # Seconds the Ray backend waits for its placement group (one bundle per rank) before giving up.
    "PAGEDSERVE_RAY_PLACEMENT_TIMEOUT": _float("PAGEDSERVE_RAY_PLACEMENT_TIMEOUT", 120.0),
    # The Ray cluster the Ray backends join (Ray reads it too); unset: one `ray start` began here, else a new one.
    "RAY_ADDRESS": lambda: os.environ.get("RAY_ADDRESS") or None,
    # vLLM's switch for POST /v1/load_lora_adapter and /v1/unload_lora_adapter (or --allow-runtime-lora-updating).
    "VLLM_ALLOW_RUNTIME_LORA_UPDATING": lambda: os.environ.get("VLLM_ALLOW_RUNTIME_LORA_UPDATING", "").lower()
    in ("1", "true"),
    # vLLM's switch for the development routes RL trainers use: /sleep, /wake_up, /is_sleeping,
    # /reset_prefix_cache, /collective_rpc (frontend/rl/dev_routes.py).
    "VLLM_SERVER_DEV_MODE": lambda: os.environ.get("VLLM_SERVER_DEV_MODE", "0").lower() in ("1", "true"),
    # vLLM's seconds an http(s) image URL in a request may take to download, all of it (frontend/multimodal/).
    "VLLM_IMAGE_FETCH_TIMEOUT": _float("VLLM_IMAGE_FETCH_TIMEOUT", 5.0),
    # "torch" runs the PyTorch kernels on CUDA too (A/B checks against the Triton ones).
    "PAGEDSERVE_KERNELS": _choice("PAGEDSERVE_KERNELS", "triton", ("triton", "torch")),
    # "1": the one-call C step takes every step of a quantized CPU Llama-family model, in passes of its row limit
    # (docs/determinism.md); "short": only steps of up to that limit, the rest on the layer stack (the split before
    # issue 50, for A/B runs); "0": the layer stack for every step.
    "PAGEDSERVE_CPU_DECODE_STEP": _choice("PAGEDSERVE_CPU_DECODE_STEP", "1", ("1", "short", "0")),
    # "0" keeps many-row int4 GEMMs on the AVX512-VNNI tile where the CPU has AMX (same bits; A/B runs).
    "PAGEDSERVE_CPU_AMX": lambda: os.environ.get("PAGEDSERVE_CPU_AMX", "1") != "0",
    # vLLM's switch for batch-invariant kernels, the default of --batch-invariant (EngineArgs.batch_invariant, which
    # is what the workers read): "1" makes every row's bits independent of the rows beside it on the CPU paths that
    # cost for it (float linears in fixed row blocks, every token's attention alone through the C kernel); the
    # quantized C step is invariant without it (docs/determinism.md).
    "VLLM_BATCH_INVARIANT": lambda: os.environ.get("VLLM_BATCH_INVARIANT", "0").lower() in ("1", "true"),
    # Defaults of secrets that are also flags (--api-key, --engine-token): never shown in --help.
    "PAGEDSERVE_API_KEY": lambda: os.environ.get("PAGEDSERVE_API_KEY") or None,
    "PAGEDSERVE_ENGINE_TOKEN": lambda: os.environ.get("PAGEDSERVE_ENGINE_TOKEN") or None,
    # OpenTelemetry's own variables for --otlp-traces-endpoint (frontend/tracing): the endpoint is the flag's
    # default; the SDK's exporter reads the other OTEL_EXPORTER_OTLP_TRACES_* (headers, timeout, TLS) itself.
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": lambda: os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or None,
    "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL": _choice("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "grpc",
                                                  ("grpc", "http/protobuf")),
    # The API key `pagedserve bench serve`, `chat` and `complete` send (the OpenAI clients' variable, as vLLM's).
    "OPENAI_API_KEY": lambda: os.environ.get("OPENAI_API_KEY") or None,
    # Where scripts/build_llama_server.sh builds llama.cpp's server (the CPU peer of the benchmarks).
    "PAGEDSERVE_LLAMA_CPP_DIR": lambda: os.environ.get("PAGEDSERVE_LLAMA_CPP_DIR")
    or os.path.join(_cache_dir(), "llama.cpp"),
    # Set by torchrun on every node: the rank's GPU on its own machine.
    "LOCAL_RANK": lambda: int(os.environ["LOCAL_RANK"]) if "LOCAL_RANK" in os.environ else None,
    # The C compiler that builds kernels/cpu/csrc (unset: cc, else gcc).
    "CC": lambda: os.environ.get("CC") or None,
}


def __getattr__(name: str) -> Any:
    if name in environment_variables:
        return environment_variables[name]()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r} (not a pagedserve environment variable)")


def __dir__() -> list[str]:
    return list(environment_variables)
