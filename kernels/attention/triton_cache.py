"""Scatter this step's K/V rows into the paged cache (Triton). Slot -1 marks padding: skipped.

An fp8 cache (FP8) stores x / scale saturated to +-448 in e4m3, as kernels/attention/kv_quant.py does."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key, value, k_cache, v_cache, slot_mapping, k_scale, v_scale,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cb, stride_ch, stride_cs,
                     NUM_KV_HEADS: tl.constexpr, HEADS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
                     HEAD_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, FP8: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_PAD)
    mask = (heads < NUM_KV_HEADS)[:, None] & (dims < HEAD_DIM)[None, :]
    dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + heads[:, None] * stride_ch + dims[None, :]
    k = tl.load(key + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    v = tl.load(value + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    if FP8:
        k = tl.clamp(k.to(tl.float32) / k_scale, -448.0, 448.0)
        v = tl.clamp(v.to(tl.float32) / v_scale, -448.0, 448.0)
    tl.store(k_cache + dst, k.to(k_cache.dtype.element_ty), mask=mask)
    tl.store(v_cache + dst, v.to(v_cache.dtype.element_ty), mask=mask)


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """key/value [T, Hkv, D] (unit dim stride) into caches [blocks, Hkv, block_size, D] at slot_mapping [T].
    k_scale / v_scale divide what an fp8 cache stores; other caches ignore them."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping, float(k_scale), float(v_scale),
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEADS_PAD=triton.next_power_of_2(num_kv_heads), HEAD_DIM=head_dim,
        HEAD_PAD=triton.next_power_of_2(head_dim), BLOCK_SIZE=k_cache.shape[2],
        FP8=k_cache.dtype == torch.float8_e4m3fn)
