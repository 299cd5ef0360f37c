"""What `--dtype` means: vLLM's choices and, for `auto`, vLLM's rule on CUDA (the checkpoint's own dtype)."""
from __future__ import annotations

import functools
from typing import Any

# vLLM's --dtype choices; "half" and "float" are its spellings of float16 and float32.
DTYPE_CHOICES = ("auto", "half", "float16", "bfloat16", "float", "float32")
_ALIASES = {"half": "float16", "float": "float32"}
_KNOWN = ("float32", "bfloat16", "float16")


def checkpoint_dtype(hf_config: Any) -> str | None:
    """The dtype a checkpoint's config.json declares (`dtype`, or `torch_dtype` in older files), or None."""
    value = getattr(hf_config, "dtype", None)
    if value is None and "torch_dtype" in getattr(hf_config, "__dict__", {}):
        value = hf_config.__dict__["torch_dtype"]
    name = str(value).removeprefix("torch.") if value is not None else None
    return name if name in _KNOWN else None


def resolve_dtype(requested: str, device: str, config_dtype: str | None,
                  cpu_native_bf16: bool | None = None, weight_only_quantized: bool = False) -> str:
    """The dtype to run in: "float32" | "bfloat16" | "float16".

    auto on CUDA follows the checkpoint, as vLLM does: float16 and bfloat16 checkpoints keep their dtype,
    float32 ones (or a config that names none) run in bfloat16. auto on CPU: bfloat16 where the CPU has it
    natively, else float32 (see below). cpu_native_bf16: None reads /proc/cpuinfo. weight_only_quantized
    (int4/int8 weights on CPU): float32, whatever the CPU (see below).
    """
    if requested not in DTYPE_CHOICES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {requested!r}")
    if requested != "auto":
        return _ALIASES.get(requested, requested)
    if device == "cuda":
        return config_dtype if config_dtype in ("float16", "bfloat16") else "bfloat16"
    if weight_only_quantized:
        # The weight-only kernels take bfloat16 activations either way (kernels/weights/weight_only.py), so the
        # dtype only decides the rest (norms, rotary, attention, the residual stream): in float32 the
        # embedded Q4_1 model gave the dequantized model's greedy tokens on 8 of 8 chat prompts, in
        # bfloat16 on 4 (tests/executor/model/quant/test_quantized_model.py), and batch-1 speed was the same.
        return "float32"
    if cpu_native_bf16 is None:
        cpu_native_bf16 = cpu_has_native_bf16()
    # Without AMX or AVX512-BF16 torch emulates bf16: measured on such a CPU, bf16 matmuls ran at
    # ~40 GFLOP/s against ~140 for float32 (docs/cpu_performance.md).
    return "bfloat16" if cpu_native_bf16 else "float32"


def resolve_kv_cache_dtype(requested: str, device: str, model_dtype: str, weight_only_quantized: bool) -> str:
    """What CacheConfig.cache_dtype holds: "fp8" | "bfloat16" | "float32" | "auto" (the model dtype).

    auto on CPU with int4/int8 weights: bfloat16. Such a model runs float32 activations only for the sake of
    its GEMVs and residual stream (resolve_dtype); a decode step reads every sequence's whole cache, so at a
    64-sequence W1 step of ~340-token contexts a float32 cache is ~1 GB of reads a step (decode attention
    76.6 ms a step against 51.7 in bfloat16, docs/cpu_performance.md). llama.cpp keeps a 16-bit cache by
    default too. Everywhere else auto is the model dtype, as in vLLM.
    """
    if requested.startswith("fp8"):
        return "fp8"
    if requested != "auto":
        return requested
    if device == "cpu" and weight_only_quantized and model_dtype == "float32":
        return "bfloat16"
    return "auto"


def cpuinfo_field(name: str) -> str:
    """The first value of a /proc/cpuinfo field ("flags", "model name"); "" where there is none (not Linux,
    or an architecture that names it otherwise)."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line.split(":", 1)[1].strip() for line in f
                         if ":" in line and line.split(":", 1)[0].strip() == name), "")
    except OSError:
        return ""


@functools.lru_cache(maxsize=1)     # read once: the weight-only kernels ask on every call
def _cpu_flags() -> frozenset[str]:
    return frozenset(cpuinfo_field("flags").split())


def cpu_has_native_bf16() -> bool:
    flags = _cpu_flags()
    return "amx_bf16" in flags or "avx512_bf16" in flags


def cpu_has_amx_bf16() -> bool:
    """AMX's bfloat16 tiles, which oneDNN's bfloat16 matmuls run on."""
    return "amx_bf16" in _cpu_flags()
