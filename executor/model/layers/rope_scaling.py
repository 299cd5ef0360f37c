"""RoPE scaling variants: (inverse frequencies, attention factor) for linear, llama3, yarn, dynamic and longrope.

Each follows transformers' ROPE_INIT_FUNCTIONS arithmetic in the same order, so the float32 tables come out
bit-identical; the attention factor multiplies cos and sin (as transformers' `attention_scaling` does).
Every table here is a function of the position alone: a cached key never depends on how long its sequence
grows later, which paged KV blocks, chunked prefill and prefix caching all rely on.
"""
from __future__ import annotations

import math
from typing import Any

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn", "dynamic", "longrope")


def rope_type(scaling: dict[str, Any] | None) -> str:
    return "default" if not scaling else str(scaling.get("rope_type", scaling.get("type", "default")))


def base_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    return 1.0 / (theta ** exponents)


def _field(scaling: dict[str, Any], name: str) -> Any:
    if scaling.get(name) is None:
        raise ValueError(f"rope_scaling: {rope_type(scaling)} scaling needs the field {name!r}")
    return scaling[name]


def _original_len(scaling: dict[str, Any], hf_config: Any) -> int:
    # transformers 4.x Phi-3 configs keep it beside rope_scaling, not inside it.
    value = scaling.get("original_max_position_embeddings") or getattr(hf_config, "original_max_position_embeddings",
                                                                        None)
    if value is None:
        raise ValueError(f"rope_scaling: {rope_type(scaling)} scaling needs 'original_max_position_embeddings'")
    return int(value)


def llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(_field(scaling, "factor"))
    low, high = float(_field(scaling, "low_freq_factor")), float(_field(scaling, "high_freq_factor"))
    old_len = float(_field(scaling, "original_max_position_embeddings"))
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(head_dim: int, theta: float, scaling: dict[str, Any], hf_config: Any) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate the slow dimensions, keep the fast ones, ramp linearly in between."""
    original = _original_len(scaling, hf_config)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else hf_config.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention = (_yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
                     if mscale and mscale_all_dim else _yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001                                   # as transformers: no division by zero
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(torch.float32) / head_dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention)


def dynamic_ntk_length(scaling: dict[str, Any], hf_config: Any) -> int:
    """The sequence length dynamic NTK's base is fixed for: max_position_embeddings * factor (vLLM's choice)."""
    return int(hf_config.max_position_embeddings * float(_field(scaling, "factor")))


def dynamic_ntk(head_dim: int, theta: float, scaling: dict[str, Any], hf_config: Any) -> torch.Tensor:
    """Dynamic NTK with the base stretched once for the longest sequence, as vLLM does.

    transformers recomputes the base from the current sequence length at every forward (and resets it once
    the sequence is short again), so keys already cached were rotated with a different base than the
    queries that read them, and one prompt's tokens rotate differently depending on how long it will grow.
    A paged, prefix-cached engine needs one table per position, so we use transformers' own formula at
    seq_len = max_position_embeddings * factor (its value once a sequence reaches that length): equal to
    transformers for sequences of that length, not for shorter ones.
    """
    factor = float(_field(scaling, "factor"))
    max_pos = hf_config.max_position_embeddings
    seq_len = dynamic_ntk_length(scaling, hf_config)
    base = theta * ((factor * seq_len / max_pos) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim))


def longrope_uses_long(scaling: dict[str, Any], hf_config: Any, max_model_len: int) -> bool:
    return max_model_len > _original_len(scaling, hf_config)


def longrope(head_dim: int, theta: float, scaling: dict[str, Any], hf_config: Any,
             max_model_len: int) -> tuple[torch.Tensor, float]:
    """LongRoPE (Phi-3): per-dimension rescale factors, short ones or long ones.

    transformers picks per forward: long factors for the whole sequence once max(position) + 1 exceeds
    original_max_position_embeddings, short ones otherwise; so a prompt longer than that is rotated with the
    long factors from position 0, and a short one rotates its prompt with the short factors and only the
    tokens generated past the boundary with the long ones, while its cached keys keep the short rotation.
    Like vLLM we pick once per engine: long factors at every position when max_model_len exceeds
    original_max_position_embeddings, else short ones. That equals transformers for every sequence longer
    than the original length (the long-context use) and, with max_model_len <= the original length, for
    all sequences; and it keeps a key's rotation independent of how far its sequence grows.
    """
    original = _original_len(scaling, hf_config)
    factor = scaling.get("factor")
    factor = float(factor) if factor is not None else hf_config.max_position_embeddings / original
    attention = scaling.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    name = "long_factor" if longrope_uses_long(scaling, hf_config, max_model_len) else "short_factor"
    ext = torch.tensor(_field(scaling, name), dtype=torch.float32)
    if ext.shape != (head_dim // 2,):
        raise ValueError(f"rope_scaling: {name} has {ext.numel()} entries, expected head_dim/2 = {head_dim // 2}")
    shape = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    return 1.0 / (ext * theta ** shape), float(attention)


def scaled_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, hf_config: Any,
                    max_model_len: int) -> tuple[torch.Tensor, float]:
    """(float32 [head_dim // 2] inverse frequencies, factor on cos/sin) for the config's rope scaling."""
    kind = rope_type(scaling)
    if kind == "default" or scaling is None:
        return base_inv_freq(head_dim, theta), 1.0
    if kind == "linear":
        return base_inv_freq(head_dim, theta) / float(_field(scaling, "factor")), 1.0
    if kind == "llama3":
        return llama3(base_inv_freq(head_dim, theta), scaling), 1.0
    if kind == "yarn":
        return yarn(head_dim, theta, scaling, hf_config)
    if kind == "dynamic":
        return dynamic_ntk(head_dim, theta, scaling, hf_config), 1.0
    if kind == "longrope":
        return longrope(head_dim, theta, scaling, hf_config, max_model_len)
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported ({', '.join(SUPPORTED)})")
