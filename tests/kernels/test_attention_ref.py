"""The PyTorch paged attention (CPU path and kernel oracle) against plain dense attention."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels.attention import reference
from pagedserve.tests.helpers.kernels.attention_cases import dense_attention, gather, make_batch


@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (6, 2), (8, 2)])
def test_paged_attention_matches_dense(block_size, hq, hkv):
    gen = torch.Generator().manual_seed(0)
    d = 32
    # decodes (more than one group of 16, unsorted lengths), a fresh prefill, continuations
    seqs = [(1 + (7 * i) % 45, 1) for i in range(19)] + [(20, 20), (50, 13), (9, 2)]
    k_cache, v_cache, tables, meta = make_batch(seqs, block_size, hkv, d, gen)
    q = torch.randn(meta.query_start_loc_cpu[-1], hq, d, generator=gen)
    scale = 1 / math.sqrt(d)
    out = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    for i, (ctx, ql) in enumerate(seqs):
        lo, hi = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        want = dense_attention(q[lo:hi], gather(k_cache, tables[i], ctx), gather(v_cache, tables[i], ctx), scale)
        torch.testing.assert_close(out[lo:hi], want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("window,softcap", [(1, None), (5, None), (16, None), (None, 0.5), (7, 2.0)])
def test_paged_attention_sliding_window_and_softcap(window, softcap):
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, block_size = 6, 2, 16, 4
    # contexts shorter, equal to and longer than the windows; decodes then prefill chunks
    seqs = [(3, 1), (7, 1), (16, 1), (40, 1), (12, 12), (30, 9), (21, 2)]
    k_cache, v_cache, tables, meta = make_batch(seqs, block_size, hkv, d, gen)
    q = torch.randn(meta.query_start_loc_cpu[-1], hq, d, generator=gen) * 3     # large scores: capping bites
    scale = 1 / math.sqrt(d)
    out = reference.paged_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    plain = reference.paged_attention(q, k_cache, v_cache, meta, scale)
    for i, (ctx, ql) in enumerate(seqs):
        lo, hi = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        want = dense_attention(q[lo:hi], gather(k_cache, tables[i], ctx), gather(v_cache, tables[i], ctx), scale,
                               window, softcap)
        torch.testing.assert_close(out[lo:hi], want, rtol=1e-4, atol=1e-5)
    assert not torch.allclose(out, plain, atol=1e-3)       # the window / cap changed something


def test_write_kv_cache_skips_padding_slots():
    k_cache = torch.zeros(4, 2, 4, 8)       # [blocks, kv heads, block size, dim]
    v_cache = torch.zeros(4, 2, 4, 8)
    key, value = torch.randn(5, 2, 8), torch.randn(5, 2, 8)
    slots = torch.tensor([3, -1, 9, -1, 15])
    reference.write_kv_cache(key, value, k_cache, v_cache, slots)
    flat_k = k_cache.transpose(1, 2).reshape(-1, 2, 8)     # slot-major view
    flat_v = v_cache.transpose(1, 2).reshape(-1, 2, 8)
    torch.testing.assert_close(flat_k[[3, 9, 15]], key[[0, 2, 4]])
    torch.testing.assert_close(flat_v[[3, 9, 15]], value[[0, 2, 4]])
    untouched = [s for s in range(16) if s not in (3, 9, 15)]
    assert flat_k[untouched].abs().sum() == 0
