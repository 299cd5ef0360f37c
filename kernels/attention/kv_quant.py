"""fp8 (e4m3) KV cache: what is stored is x / scale saturated to e4m3's range; what is read is code * scale.

One float32 scale per layer for K and one for V (vLLM's k_scale / v_scale), 1.0 when the checkpoint has none.
A cache in any other dtype stores values as they are and ignores the scales, so `auto` is unchanged.
"""
from __future__ import annotations

import torch

FP8_KV_DTYPE = torch.float8_e4m3fn
# e4m3fn has no infinity: a value past 448 would round to NaN, so writes clamp to +-448 first (saturate).
FP8_KV_MAX = torch.finfo(FP8_KV_DTYPE).max


def is_fp8(cache: torch.Tensor) -> bool:
    return cache.dtype == FP8_KV_DTYPE


def quantize_kv(x: torch.Tensor, scale: float, cache_dtype: torch.dtype) -> torch.Tensor:
    """x as the cache stores it: x / scale saturated and rounded to e4m3, or just cast for a float cache."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype)
    return (x.float() / scale).clamp(-FP8_KV_MAX, FP8_KV_MAX).to(FP8_KV_DTYPE)


def dequantize_kv(codes: torch.Tensor, scale: float) -> torch.Tensor:
    """Gathered cache rows as float32 values (codes * scale); a float cache's rows come back untouched."""
    if codes.dtype != FP8_KV_DTYPE:
        return codes
    return codes.float() * scale


_CACHE_DTYPES = {"fp8": FP8_KV_DTYPE, "bfloat16": torch.bfloat16, "float32": torch.float32}


def kv_cache_torch_dtype(cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element type of the cache for CacheConfig.cache_dtype ("auto" | "bfloat16" | "float32" | "fp8")."""
    if cache_dtype == "auto":
        return model_dtype
    if cache_dtype not in _CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype must be auto, {', '.join(_CACHE_DTYPES)}, got {cache_dtype!r}")
    return _CACHE_DTYPES[cache_dtype]


def check_fp8_kv_device(device: torch.device) -> None:
    """Raise ValueError where the Triton kernels cannot convert e4m3 (CUDA below compute capability 8.9).
    CPU runs the PyTorch reference, which converts anywhere."""
    if device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(f"kv_cache_dtype 'fp8' needs compute capability 8.9+ (Ada/Hopper) for e4m3 in "
                             f"Triton, this GPU is {capability[0]}.{capability[1]}; use kv_cache_dtype 'auto'")
