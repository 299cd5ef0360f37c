"""Paged attention and the cache write, done the plain way: the oracle every attention backend is tested
against, and the backend of last resort (kernels/attention/backends.py: CUDA without Triton, or
PAGEDSERVE_KERNELS=torch; on CPU the layers that the in-place path does not take: sliding windows,
soft-capping, an fp8 cache).

Each sequence's context is gathered into a dense tensor and masked: simple, and correct for every mix of
decodes (one query token, or several when verifying a draft: meta.decode_query_len) and prefill chunks.

Cache layout: [num_blocks, num_kv_heads, block_size, head_dim] per K and V. Head-major blocks let one
KV head's context be gathered as whole contiguous rows (index_select, i.e. memcpy) straight into the
[kv_heads, seqs, len, head_dim] layout attention wants, with no strided copy.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.attention.kv_quant import dequantize_kv, quantize_kv
from pagedserve.kernels.attention.metadata import AttentionMetadata

DECODE_GROUP = 16       # one-token decodes attended together, their contexts padded to the group's longest


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Scatter key/value [T, Hkv, D] into the caches at slot_mapping (block * block_size + offset; -1 skipped).
    An fp8 cache stores key / k_scale and value / v_scale (kernels/attention/kv_quant.py); a float cache ignores them."""
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
    """
    out = torch.empty_like(query)
    # One-token decodes in groups: each group gathers its context padded only to its own longest member
    # (the runner sorts decodes by length, so groups are tight). Decodes of several tokens (a draft being
    # verified) are attended one sequence at a time below, causal inside the draft, like prefill chunks.
    grouped = meta.num_decodes if meta.decode_query_len == 1 else 0
    for lo in range(0, grouped, DECODE_GROUP):
        hi = min(lo + DECODE_GROUP, grouped)
        out[lo:hi] = _decode_attention(query[lo:hi], k_cache, v_cache, meta.block_tables[lo:hi],
                                       meta.seq_lens[lo:hi], max(meta.seq_lens_cpu[lo:hi]), scale,
                                       window, softcap, k_scale, v_scale)
    starts = meta.query_start_loc_cpu
    for i in range(grouped, meta.num_seqs):
        lo, hi = starts[i], starts[i + 1]
        if hi > lo:
            until = None if meta.visible_until is None else meta.visible_until[lo:hi]
            out[lo:hi] = _prefill_attention(query[lo:hi], k_cache, v_cache, meta.block_tables[i:i + 1],
                                            meta.seq_lens_cpu[i], scale, window, softcap, k_scale, v_scale, until)
    return out


def encoder_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, meta: AttentionMetadata,
                      scale: float) -> torch.Tensor:
    """Bidirectional attention with no KV cache (encoders: BERT): each sequence's query tokens [T, H, D]
    attend to all of that sequence's tokens of this step, none cached. One SDPA call per sequence, with no
    mask: a masked call over sequences padded to the longest takes PyTorch's unfused path on CPU and computes
    the padding (3x slower for 30 prompts of 32-512 tokens). Runs on any device."""
    starts = meta.query_start_loc_cpu
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads:
        key, value = (t.repeat_interleave(heads // kv_heads, dim=1) for t in (key, value))
    out = torch.empty_like(query)
    for lo, hi in zip(starts, starts[1:]):
        q, k, v = (t[lo:hi].transpose(0, 1).unsqueeze(0) for t in (query, key, value))     # [1, H, L, D]
        out[lo:hi] = F.scaled_dot_product_attention(q, k, v, scale=scale)[0].transpose(0, 1)
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
                       softcap: float | None = None, k_scale: float = 1.0, v_scale: float = 1.0,
                       visible_until: torch.Tensor | None = None) -> torch.Tensor:
    """visible_until [qlen]: each query row's last visible key (None: its own position, causal)."""
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
    last = q_pos if visible_until is None else visible_until.to(q_pos.device, q_pos.dtype).repeat(group)
    mask = key_pos <= last[:, None]
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
