"""Random paged-attention batches and the plain dense attention they are checked against, shared by the
reference and the kernel tests."""
from __future__ import annotations

import torch

from pagedserve.kernels.attention.metadata import AttentionMetadata


def make_batch(seqs: list[tuple[int, int]], block_size: int, hkv: int, d: int, gen: torch.Generator,
               dtype: torch.dtype = torch.float32, share_prefix: int = 0):
    """seqs: (context incl. new tokens, new tokens), decodes first. Random, non-contiguous block tables;
    the first share_prefix blocks of every sequence are the same physical blocks (a prefix-cache hit)."""
    num_blocks = 4 + sum(-(-ctx // block_size) for ctx, _ in seqs)
    k_cache = torch.randn(num_blocks, hkv, block_size, d, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, hkv, block_size, d, generator=gen).to(dtype)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    shared = [perm.pop() for _ in range(share_prefix)]
    tables, starts, lens = [], [0], []
    for ctx, new in seqs:
        nb = -(-ctx // block_size)
        own = max(0, nb - share_prefix)
        tables.append((shared[:nb] + [perm.pop() for _ in range(own)]))
        starts.append(starts[-1] + new)
        lens.append(ctx)
    width = max(len(t) for t in tables) + 2          # unused trailing entries, as the runner leaves them
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((starts[-1],), -1, dtype=torch.int64),
        query_start_loc=torch.tensor(starts, dtype=torch.int32), seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=bt, num_decodes=sum(1 for _, n in seqs if n == 1),
        max_query_len=max(n for _, n in seqs), max_seq_len=max(lens),
        query_start_loc_cpu=starts, seq_lens_cpu=lens)
    return k_cache, v_cache, tables, meta


def dense_attention(q, k, v, scale, window=None, softcap=None, until=None):
    """q [n, Hq, D] at the last n positions of k/v [L, Hkv, D]; causal, optionally windowed and soft-capped.
    until [n]: each query's last visible key (Gemma 3's image rows see their image's end), else its own."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1)
    v = v.repeat_interleave(hq // hkv, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    q_pos = torch.arange(L - n, L)[:, None]
    hidden = torch.arange(L)[None, :] > (q_pos if until is None else until[:, None])
    if window is not None:
        hidden = hidden | (torch.arange(L)[None, :] <= q_pos - window)
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def gather(cache, table, ctx):
    """[ctx, Hkv, D] the slow, obvious way."""
    return torch.cat([cache[b].transpose(0, 1) for b in table])[:ctx]
