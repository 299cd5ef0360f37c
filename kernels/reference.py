"""PyTorch paged attention and cache write: the CPU path and the oracle for the Triton kernels."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.metadata import AttentionMetadata

DECODE_GROUP = 16


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter key/value [T, Hkv, D] into caches [num_blocks, block_size, Hkv, D] at slot_mapping (-1 skipped)."""
    num_kv_heads, head_dim = key.shape[1], key.shape[2]
    valid = slot_mapping >= 0
    slots = slot_mapping
    if not bool(valid.all()):
        slots, key, value = slot_mapping[valid], key[valid], value[valid]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slots, value.to(v_cache.dtype))


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of query [T, Hq, D] over each sequence's paged context; returns [T, Hq, D]."""
    out = torch.empty_like(query)
    # Decodes in groups: each group gathers its context padded only to its own longest member
    # (the runner sorts decodes by length, so groups are tight).
    for lo in range(0, meta.num_decodes, DECODE_GROUP):
        hi = min(lo + DECODE_GROUP, meta.num_decodes)
        out[lo:hi] = _decode_attention(query[lo:hi], k_cache, v_cache, meta.block_tables[lo:hi],
                                       meta.seq_lens[lo:hi], max(meta.seq_lens_cpu[lo:hi]), scale)
    nd = meta.num_decodes
    starts = meta.query_start_loc_cpu
    for i in range(nd, meta.num_seqs):
        lo, hi = starts[i], starts[i + 1]
        if hi > lo:
            out[lo:hi] = _prefill_attention(query[lo:hi], k_cache, v_cache, meta.block_tables[i],
                                            meta.seq_lens_cpu[i], scale)
    return out


def _gather_context(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """cache[block_table] flattened to [..., length, Hkv, D] (block_table [..., nblocks])."""
    block_size = cache.shape[1]
    nblocks = -(-length // block_size)
    blocks = cache[block_table[..., :nblocks]]          # [..., nblocks, bs, Hkv, D]
    shape = blocks.shape[:-4] + (nblocks * block_size,) + blocks.shape[-2:]
    return blocks.reshape(shape)[..., :length, :, :]


def _decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int,
                      scale: float) -> torch.Tensor:
    batch, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = _gather_context(k_cache, block_tables, max_len).transpose(1, 2)     # [B, Hkv, L, D]
    values = _gather_context(v_cache, block_tables, max_len).transpose(1, 2)
    # GQA without repeating K/V: the query heads of one KV head become that head's query rows.
    q = query.view(batch, num_kv_heads, group, head_dim).to(keys.dtype)
    mask = torch.arange(max_len, device=query.device)[None, :] < seq_lens[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None, None, :], scale=scale)
    return out.reshape(batch, num_heads, head_dim).to(query.dtype)


def _prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                       block_table: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    qlen, num_heads, head_dim = query.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    keys = _gather_context(k_cache, block_table, seq_len).transpose(0, 1)      # [Hkv, L, D]
    values = _gather_context(v_cache, block_table, seq_len).transpose(0, 1)
    q = query.view(qlen, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)   # [Hkv, G, q, D]
    q = q.reshape(num_kv_heads, group * qlen, head_dim).to(keys.dtype)
    # Query row i sits at absolute position seq_len - qlen + i and sees keys up to it.
    q_pos = torch.arange(seq_len - qlen, seq_len, device=query.device).repeat(group)
    mask = torch.arange(seq_len, device=query.device)[None, :] <= q_pos[:, None]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    out = out.view(num_kv_heads, group, qlen, head_dim).permute(2, 0, 1, 3)
    return out.reshape(qlen, num_heads, head_dim).to(query.dtype)
