"""PyTorch ops: the CPU path and the oracle for the Triton kernels (paged attention, cache write,
RMSNorm, SiLU*mul, q/k norm + rotary).

Cache layout: [num_blocks, num_kv_heads, block_size, head_dim] per K and V. Head-major blocks let one
KV head's context be gathered as whole contiguous rows (index_select, i.e. memcpy) straight into the
[kv_heads, seqs, len, head_dim] layout attention wants, with no strided copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels import cpu_attention
from pagedserve.kernels.cpu_attention import DECODE_GROUP
from pagedserve.kernels.kv_quant import dequantize_kv, quantize_kv
from pagedserve.kernels.metadata import AttentionMetadata


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Scatter key/value [T, Hkv, D] into the caches at slot_mapping (block * block_size + offset; -1 skipped).
    An fp8 cache stores key / k_scale and value / v_scale (kernels/kv_quant.py)."""
    if k_cache.dtype.itemsize > 1:       # a float cache: the in-place path of cpu_attention
        cpu_attention.write_kv_cache(key, value, k_cache, v_cache, cpu_attention.write_plan(slot_mapping, k_cache))
        return
    block_size = k_cache.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping
    if not bool(valid.all()):
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, :, offsets] = quantize_kv(key, k_scale, k_cache.dtype)
    v_cache[blocks, :, offsets] = quantize_kv(value, v_scale, v_cache.dtype)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None,
                    softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each sequence's paged context; returns [T, Hq, D].

    window: a query at position p sees only keys at positions > p - window (None: all earlier keys).
    softcap: scores become tanh(scores / softcap) * softcap before the softmax (Gemma 2).
    k_scale / v_scale: an fp8 cache's scales; its gathered rows are dequantized to float32 before attending.
    A float cache without window or cap takes the in-place path of cpu_attention (blocks read in place, plans
    shared by layers); the rest take the straightforward gather-and-mask path below.
    """
    if window is None and softcap is None and k_cache.dtype.itemsize > 1:
        kv_rows = cpu_attention.stacked_rows(k_cache, v_cache)
        decoded = cpu_attention.decode_native(query, k_cache, v_cache, meta, scale)
        plan = cpu_attention.step_plan(meta, k_cache, kv_rows is not None, decodes=decoded is None)
        return cpu_attention.paged_attention(query, k_cache, v_cache, kv_rows, plan, scale, decoded)
    out = torch.empty_like(query)
    # Decodes in groups: each group gathers its context padded only to its own longest member
    # (the runner sorts decodes by length, so groups are tight).
    for lo in range(0, meta.num_decodes, DECODE_GROUP):
        hi = min(lo + DECODE_GROUP, meta.num_decodes)
        out[lo:hi] = _decode_attention(query[lo:hi], k_cache, v_cache, meta.block_tables[lo:hi],
                                       meta.seq_lens[lo:hi], max(meta.seq_lens_cpu[lo:hi]), scale,
                                       window, softcap, k_scale, v_scale)
    starts = meta.query_start_loc_cpu
    for i in range(meta.num_decodes, meta.num_seqs):
        lo, hi = starts[i], starts[i + 1]
        if hi > lo:
            out[lo:hi] = _prefill_attention(query[lo:hi], k_cache, v_cache, meta.block_tables[i:i + 1],
                                            meta.seq_lens_cpu[i], scale, window, softcap, k_scale, v_scale)
    return out


def gather_context(cache: torch.Tensor, block_tables: torch.Tensor, length: int,
                   scale: float = 1.0) -> torch.Tensor:
    """The first `length` cached positions of each sequence: [Hkv, S, length, D] (block_tables [S, n]);
    an fp8 cache's rows come back as float32 values (codes * scale)."""
    num_blocks, num_kv_heads, block_size, head_dim = cache.shape
    nblocks = -(-length // block_size)
    ids = block_tables[:, :nblocks].reshape(-1).long()
    seqs = block_tables.shape[0]
    out = torch.empty(num_kv_heads, seqs * nblocks, block_size * head_dim, dtype=cache.dtype, device=cache.device)
    rows = cache.view(num_blocks, num_kv_heads, block_size * head_dim)
    for h in range(num_kv_heads):
        torch.index_select(rows[:, h], 0, ids, out=out[h])
    return dequantize_kv(out.view(num_kv_heads, seqs, nblocks * block_size, head_dim)[:, :, :length], scale)


def _decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                      scale: float, window: int | None = None, softcap: float | None = None,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    keys = gather_context(k_cache, block_tables, max_len, k_scale).transpose(0, 1)      # [B, Hkv, L, D]
    values = gather_context(v_cache, block_tables, max_len, v_scale).transpose(0, 1)
    # GQA without repeating K/V: the query heads of one KV head become that head's query rows.
    q = query.view(batch, num_kv_heads, group, head_dim)
    key_pos = torch.arange(max_len, device=query.device)[None, :]
    mask = key_pos < seq_lens[:, None]
    if window is not None:      # the query sits at seq_len - 1
        mask = mask & (key_pos > seq_lens[:, None] - 1 - window)
    out = _attend(q, keys, values, mask[:, None, None, :], scale, softcap)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def _prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_len: int, scale: float, window: int | None = None,
                       softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
    qlen, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[1]
    group = num_heads // num_kv_heads
    keys = gather_context(k_cache, block_table, seq_len, k_scale)[:, 0]               # [Hkv, L, D]
    values = gather_context(v_cache, block_table, seq_len, v_scale)[:, 0]
    q = query.view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)   # [Hkv, G, q, D]
    q = q.reshape(num_kv_heads, group * qlen, head_dim)
    # Query row i sits at absolute position seq_len - qlen + i and sees keys up to it.
    q_pos = torch.arange(seq_len - qlen, seq_len, device=query.device).repeat(group)
    key_pos = torch.arange(seq_len, device=query.device)[None, :]
    mask = key_pos <= q_pos[:, None]
    if window is not None:
        mask = mask & (key_pos > q_pos[:, None] - window)
    out = _attend(q, keys, values, mask, scale, softcap)
    out = out.view(num_kv_heads, group, qlen, head_dim).permute(2, 0, 1, 3)
    return out.reshape(qlen, num_heads, head_dim).to(query.dtype)


def _attend(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scale: float,
            softcap: float | None) -> torch.Tensor:
    """softmax(mask(q @ k^T * scale)) @ v; SDPA has no soft-capping, so capped scores are formed by hand."""
    # A float32 query over a 16-bit cache attends in float32: rounding the query would add error the cache
    # did not.
    work = torch.promote_types(q.dtype, keys.dtype)
    q, keys, values = q.to(work), keys.to(work), values.to(work)
    if softcap is None:
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), values)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """norm(x) * weight, or with a residual (norm(x + residual) * weight, x + residual)."""
    if residual is None:
        return _rms_norm(x, weight, eps)
    x = x + residual
    return _rms_norm(x, weight, eps), x


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same op order as transformers' LlamaRMSNorm: normalise in float32, cast back, then scale.
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] = [gate | up] -> silu(gate) * up [..., d]."""
    half = x.shape[-1] // 2
    return F.silu(x[..., :half]) * x[..., half:]


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [T, H, D] (any strides) rotated, neox layout; cos/sin [T, 1, D] in x's dtype. Returns a new tensor."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def qk_norm_rope(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_q_heads: int,
                 q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                 eps: float = 1e-6) -> torch.Tensor:
    """qk [T, Hq + Hkv, D]: optional per-head RMSNorm (Qwen3), then rotary; cos/sin [T, 1, D]."""
    if q_weight is not None:
        qk = torch.cat((_rms_norm(qk[:, :num_q_heads], q_weight, eps),
                        _rms_norm(qk[:, num_q_heads:], k_weight, eps)), dim=1)
    return apply_rotary(qk, cos.view(cos.shape[0], 1, -1), sin.view(sin.shape[0], 1, -1))
