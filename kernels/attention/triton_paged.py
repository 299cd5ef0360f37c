"""Paged attention in Triton: one launch for a mixed batch of prefill chunks and decodes.

Each program owns BLOCK_M query rows of one sequence for one KV head: BLOCK_Q consecutive new tokens
times the G query heads that share that KV head (GQA without repeating K/V). It walks the sequence's
context through its block table in tiles of TILE tokens with an online softmax. The grid needs no
per-step host metadata: program i finds its sequence by binary search over query_start_loc, so the
same launch works for any mix and inside a CUDA graph.

Sliding window (WINDOW > 0): a row at position p sees keys > p - WINDOW only, and a program starts at the
first tile its earliest row can see, so a long context costs only the window. SOFTCAP > 0 caps the scaled
scores as tanh(s / SOFTCAP) * SOFTCAP (Gemma 2).

fp8 cache: K and V tiles are loaded as e4m3 codes and converted to the query's dtype (exact: e4m3 fits in
fp16/bf16); k_scale is folded into the softmax scale on the host and v_scale multiplies the accumulator once
at the end, so dequantizing costs no per-element multiply.

Split-KV (flash-decoding): with NUM_SPLITS > 1 every program covers one slice of the context and
writes an unnormalised partial result; a second kernel merges the slices. Small decode batches use
it so that long contexts still occupy every multiprocessor.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.attention.metadata import AttentionMetadata


@triton.jit
def _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """The sequence whose range of q-blocks holds q_block (sequence s starts at qsl[s] // BLOCK_Q + s)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        start = tl.load(query_start_loc + mid) // BLOCK_Q + mid
        if start <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _paged_attention_kernel(
        out_ptr, q_ptr, k_cache, v_cache, block_tables, seq_lens, query_start_loc,
        part_out, part_max, part_sum, scale, v_scale, num_seqs, window,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_ch, stride_cs, stride_bt,
        NUM_HEADS: tl.constexpr, G: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, TILE: tl.constexpr,
        NUM_SPLITS: tl.constexpr, IEEE: tl.constexpr, HAS_WINDOW: tl.constexpr, SOFTCAP: tl.constexpr):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = _find_seq(query_start_loc, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc + seq)
    q_len = tl.load(query_start_loc + seq + 1) - q_start
    local = q_block - (q_start // BLOCK_Q + seq)
    if local * BLOCK_Q >= q_len:      # the grid is an upper bound: spare programs leave at once
        return
    context = tl.load(seq_lens + seq) - q_len          # tokens cached before this step's

    rows = tl.arange(0, BLOCK_M)
    q_tok = local * BLOCK_Q + rows // G                 # index among this sequence's new tokens
    head = kv_head * G + rows % G
    row_ok = (rows // G < BLOCK_Q) & (q_tok < q_len)
    dims = tl.arange(0, HEAD_PAD)
    dim_ok = dims < HEAD_DIM
    token = (q_start + q_tok).to(tl.int64)
    q = tl.load(q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
                mask=row_ok[:, None] & dim_ok[None, :], other=0.0)
    q_pos = context + q_tok                              # absolute position of each row's token

    # Causal: this q-block needs keys up to its last token's position.
    kv_end = context + tl.minimum((local + 1) * BLOCK_Q, q_len)
    first_tile = 0
    if HAS_WINDOW:      # tiles wholly before the window of this q-block's first token are skipped
        first_tile = tl.maximum(context + local * BLOCK_Q - window + 1, 0) // TILE
    num_tiles = tl.cdiv(kv_end, TILE) - first_tile
    per_split = tl.cdiv(num_tiles, NUM_SPLITS)
    tile_lo = first_tile + split * per_split
    tile_hi = tl.minimum(tile_lo + per_split, first_tile + num_tiles)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_PAD], tl.float32)
    offs = tl.arange(0, TILE)
    table = block_tables + seq.to(tl.int64) * stride_bt
    for tile in range(tile_lo, tile_hi):
        pos = tile * TILE + offs
        pos_ok = pos < kv_end
        block = tl.load(table + pos // BLOCK_SIZE, mask=pos_ok, other=0).to(tl.int64)
        slot = block * stride_cb + kv_head * stride_ch + (pos % BLOCK_SIZE) * stride_cs
        k = tl.load(k_cache + slot[None, :] + dims[:, None], mask=pos_ok[None, :] & dim_ok[:, None], other=0.0)
        v = tl.load(v_cache + slot[:, None] + dims[None, :], mask=pos_ok[:, None] & dim_ok[None, :], other=0.0)
        k = k.to(q.dtype)       # no-op unless the cache is fp8
        v = v.to(q.dtype)
        if IEEE:
            scores = tl.dot(q, k, input_precision="ieee")
        else:
            scores = tl.dot(q, k)
        allowed = row_ok[:, None] & pos_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        if HAS_WINDOW:
            allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
        scores = scores * scale
        if SOFTCAP > 0:     # tanh(x) = 1 - 2 / (exp(2x) + 1): saturates cleanly, no libdevice needed
            scores = SOFTCAP * (1.0 - 2.0 / (tl.exp(scores * (2.0 / SOFTCAP)) + 1.0))
        scores = tl.where(allowed, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)    # a row with nothing visible yet
        p = tl.exp(scores - m_use[:, None])
        alpha = tl.exp(m_i - m_use)
        l_i = l_i * alpha + tl.sum(p, 1)
        if IEEE:
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
        else:
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new

    acc = acc * v_scale
    store_mask = row_ok[:, None] & dim_ok[None, :]
    if NUM_SPLITS == 1:
        out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        tl.store(out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=store_mask)
    else:
        part = (token * NUM_HEADS + head) * NUM_SPLITS + split          # [T, H, S] row-major
        tl.store(part_max + part, m_i, mask=row_ok)
        tl.store(part_sum + part, l_i, mask=row_ok)
        tl.store(part_out + part[:, None] * HEAD_PAD + dims[None, :], acc, mask=row_ok[:, None])


@triton.jit
def _merge_splits_kernel(out_ptr, part_out, part_max, part_sum, stride_ot, stride_oh,
                         NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_PAD: tl.constexpr,
                         NUM_SPLITS: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    base = (token * NUM_HEADS + head) * NUM_SPLITS
    splits = tl.arange(0, NUM_SPLITS)
    dims = tl.arange(0, HEAD_PAD)
    maxes = tl.load(part_max + base + splits)
    sums = tl.load(part_sum + base + splits)
    top = tl.max(maxes, 0)
    weights = tl.exp(maxes - tl.where(top == float("-inf"), 0.0, top))     # empty slices weigh 0
    denom = tl.sum(weights * sums, 0)
    parts = tl.load(part_out + (base + splits)[:, None] * HEAD_PAD + dims[None, :])
    out = tl.sum(parts * weights[:, None], 0) / tl.where(denom == 0.0, 1.0, denom)
    tl.store(out_ptr + token * stride_ot + head * stride_oh + dims, out.to(out_ptr.dtype.element_ty),
             mask=dims < HEAD_DIM)


def _num_splits(meta: AttentionMetadata, num_kv_heads: int) -> int:
    """Split the context only for decode-only batches too small to fill the GPU by themselves.

    Depends on shapes alone (never on host copies of lengths), so a captured CUDA graph stays valid.
    """
    if meta.max_query_len != 1:
        return 1
    programs = meta.num_seqs * num_kv_heads
    if programs >= 128:
        return 1
    return 4 if programs >= 32 else 16


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, num_splits: int | None = None,
                    window: int | None = None, softcap: float | None = None, k_scale: float = 1.0,
                    v_scale: float = 1.0) -> torch.Tensor:
    """query [T, Hq, D] (any row stride, unit dim stride); caches [blocks, Hkv, block_size, D].

    window: keys at positions > query position - window only (None: global); softcap: tanh score capping.
    k_scale / v_scale: an fp8 cache's scales (a float cache ignores them, as the reference does).
    """
    if k_cache.dtype != torch.float8_e4m3fn:
        k_scale = v_scale = 1.0
    num_tokens, num_heads, head_dim = query.shape
    _, num_kv_heads, block_size, _ = k_cache.shape
    group = num_heads // num_kv_heads
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=query.dtype, device=query.device)
    if num_tokens == 0:
        return out
    head_pad = max(16, triton.next_power_of_2(head_dim))
    block_m = max(16 if meta.max_query_len == 1 else 64, triton.next_power_of_2(group))
    block_q = block_m // group
    splits = num_splits or _num_splits(meta, num_kv_heads)
    grid = (num_tokens // block_q + meta.num_seqs, num_kv_heads, splits)
    if splits > 1:
        part_out = torch.empty(num_tokens * num_heads * splits, head_pad, dtype=torch.float32, device=query.device)
        part_max = torch.empty(num_tokens * num_heads * splits, dtype=torch.float32, device=query.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_out = part_max = part_sum = out      # unused
    _paged_attention_kernel[grid](
        out, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
        part_out, part_max, part_sum, scale * k_scale, float(v_scale), meta.num_seqs, window or 0,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_tables.stride(0),
        NUM_HEADS=num_heads, G=group, HEAD_DIM=head_dim, HEAD_PAD=head_pad, BLOCK_SIZE=block_size,
        BLOCK_M=block_m, BLOCK_Q=block_q, TILE=64 if head_pad <= 128 else 32, NUM_SPLITS=splits,
        IEEE=query.dtype == torch.float32, HAS_WINDOW=window is not None, SOFTCAP=float(softcap or 0.0),
        num_warps=4)
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part_out, part_max, part_sum, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, HEAD_PAD=head_pad, NUM_SPLITS=splits)
    return out
