"""The in-place CPU paged attention (kernels/attention/cpu_paged.py) against the plain formulas: stacked and
separate K/V caches, GQA, block boundaries, masks, slot -1, and the per-step plans reused across layers.
Decodes run through the C kernel (kernels/cpu/csrc/decode_attention.c) where it builds, and through SDPA
(`native=False`: the path without it) in the same cases."""
from __future__ import annotations

import math

import pytest
import torch

from pagedserve.kernels import torch_fused
from pagedserve.kernels.attention import cpu_paged as cpu_attention
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.tests.helpers.kernels.attention_cases import dense_attention, gather, make_batch


needs_native = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")


def _attention(q, k_cache, v_cache, meta, scale, native: bool):
    if native:
        return cpu_attention.attend(q, k_cache, v_cache, meta, scale)
    kv_rows = cpu_attention.stacked_rows(k_cache, v_cache)
    plan = cpu_attention.step_plan(meta, k_cache, kv_rows is not None)
    return cpu_attention.paged_attention(q, k_cache, v_cache, kv_rows, plan, scale)


def _check(out, q, k_cache, v_cache, tables, meta, seqs, scale, **tol):
    for i, (ctx, _) in enumerate(seqs):
        lo, hi = meta.query_start_loc_cpu[i], meta.query_start_loc_cpu[i + 1]
        want = dense_attention(q[lo:hi].float(), gather(k_cache, tables[i], ctx).float(),
                               gather(v_cache, tables[i], ctx).float(), scale)
        torch.testing.assert_close(out[lo:hi].float(), want, **tol)


# (context, new tokens): one decode on a block boundary, one just past it; equal-length groups (no mask)
# and ragged ones (mask); more than one decode group; prefills fresh and continued.
CASES = {
    "batch1_boundary": [(32, 1)],
    "batch1_past_boundary": [(33, 1)],
    "equal_lengths": [(20, 1)] * 5,
    "ragged_two_groups": [(1 + (5 * i) % 37, 1) for i in range(18)],
    "mixed": [(17, 1), (3, 1), (16, 16), (40, 7), (9, 1)],
    "prefill_only": [(40, 7)],
    "fresh_prompt_only": [(45, 45)],
}


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("hq,hkv", [(4, 4), (9, 3)])
@pytest.mark.parametrize("stacked", [True, False])
@pytest.mark.parametrize("d", [16, 64])       # the C kernel's generic loops, and its AVX-512 ones (d % 64 == 0)
def test_paged_attention_matches_dense(case, hq, hkv, stacked, native, d):
    seqs = sorted(CASES[case], key=lambda s: s[1] != 1)      # decodes first, as the runner orders them
    gen = torch.Generator().manual_seed(1)
    block_size = 16
    k_cache, v_cache, tables, meta = make_batch(seqs, block_size, hkv, d, gen)
    if stacked:
        kv = torch.stack((k_cache, v_cache))
        k_cache, v_cache = kv[0], kv[1]
        assert cpu_attention.stacked_rows(k_cache, v_cache) is not None
    else:
        assert cpu_attention.stacked_rows(k_cache, v_cache) is None
    q = torch.randn(meta.query_start_loc_cpu[-1], hq, d, generator=gen)
    scale = 1 / math.sqrt(d)
    out = _attention(q, k_cache, v_cache, meta, scale, native)
    _check(out, q, k_cache, v_cache, tables, meta, seqs, scale, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("seqs", [[(130, 1)], [(130, 1), (7, 1), (64, 1)]])
@pytest.mark.parametrize("d", [64, 128])
def test_bf16_decode_matches_dense(seqs, native, d):
    gen = torch.Generator().manual_seed(2)
    k_cache, v_cache, tables, meta = make_batch(seqs, 16, 3, d, gen, dtype=torch.bfloat16)
    kv = torch.stack((k_cache, v_cache))
    q = torch.randn(len(seqs), 9, d, generator=gen).to(torch.bfloat16)
    out = _attention(q, kv[0], kv[1], meta, 0.125, native)
    _check(out, q, kv[0], kv[1], tables, meta, seqs, 0.125, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("seqs", [[(45, 45)], [(130, 1), (40, 40), (70, 9)]])
def test_float32_query_over_a_bf16_cache_attends_in_float32(seqs):
    """The CPU default for int4/int8 weights: the cache rounds K and V, the query stays float32 (within float32
    summation of the cached values themselves)."""
    gen = torch.Generator().manual_seed(3)
    k_cache, v_cache, tables, meta = make_batch(seqs, 16, 3, 64, gen, dtype=torch.bfloat16)
    kv = torch.stack((k_cache, v_cache))
    q = torch.randn(meta.query_start_loc_cpu[-1], 9, 64, generator=gen)
    out = _attention(q, kv[0], kv[1], meta, 0.125, native=True)
    assert out.dtype == torch.float32
    _check(out, q, kv[0], kv[1], tables, meta, seqs, 0.125, rtol=1e-4, atol=1e-5)


@needs_native
def test_decodes_take_the_c_kernel_within_its_limits():
    gen = torch.Generator().manual_seed(4)
    seqs = [(300, 1), (5, 1), (40, 3)]                  # two decodes, one prefill: the kernel takes the decodes
    for block_size, hq, hkv, d, taken in [(16, 9, 3, 64, True), (256, 4, 2, 16, False),   # block past 128
                                          (16, 34, 2, 16, False), (16, 4, 1, 512, False)]:  # group, head dim
        k_cache, v_cache, tables, meta = make_batch(seqs, block_size, hkv, d, gen)
        q = torch.randn(meta.query_start_loc_cpu[-1], hq, d, generator=gen)
        decoded = cpu_attention.decode_native(q, k_cache, v_cache, meta, 0.1)
        assert (decoded is not None) == taken
        out = cpu_attention.attend(q, k_cache, v_cache, meta, 0.1)
        if taken:
            assert torch.equal(out[:2], decoded)
        _check(out, q, k_cache, v_cache, tables, meta, seqs, 0.1, rtol=1e-4, atol=1e-5)


def test_plan_follows_each_step_not_a_stale_one():
    """Layers of one step share a plan; the next step (new metadata, or the same tensors changed in
    place) must not reuse it."""
    gen = torch.Generator().manual_seed(3)
    seqs = [(40, 1), (7, 1)]
    k_cache, v_cache, tables, meta = make_batch(seqs, 4, 2, 8, gen)
    q = torch.randn(2, 4, 8, generator=gen)
    first = cpu_attention.attend(q, k_cache, v_cache, meta, 0.3)
    assert torch.equal(cpu_attention.attend(q, k_cache, v_cache, meta, 0.3), first)
    meta.seq_lens[1] = 5                       # in place: the plan's mask must change
    meta.seq_lens_cpu[1] = 5
    out = cpu_attention.attend(q, k_cache, v_cache, meta, 0.3)
    _check(out, q, k_cache, v_cache, tables, meta, [(40, 1), (5, 1)], 0.3, rtol=1e-4, atol=1e-5)
    assert not torch.equal(out[1], first[1])


@pytest.mark.parametrize("stacked", [True, False])
def test_write_kv_cache_skips_padding_and_follows_new_slots(stacked):
    kv = torch.zeros(2, 4, 3, 4, 8)            # [K/V, blocks, kv heads, block size, dim]
    k_cache, v_cache = (kv[0], kv[1]) if stacked else (kv[0].clone(), kv[1].clone())
    key, value = torch.randn(5, 3, 8), torch.randn(5, 3, 8)
    slots = torch.tensor([3, -1, 9, -1, 15])
    cpu_attention.write_kv_cache(key, value, k_cache, v_cache, cpu_attention.write_plan(slots, k_cache))
    flat_k = k_cache.transpose(1, 2).reshape(-1, 3, 8)      # slot-major view
    flat_v = v_cache.transpose(1, 2).reshape(-1, 3, 8)
    torch.testing.assert_close(flat_k[[3, 9, 15]], key[[0, 2, 4]])
    torch.testing.assert_close(flat_v[[3, 9, 15]], value[[0, 2, 4]])
    untouched = [s for s in range(16) if s not in (3, 9, 15)]
    assert flat_k[untouched].abs().sum() == 0 and flat_v[untouched].abs().sum() == 0
    slots[1] = 4                               # changed in place: written now, not skipped by a stale plan
    cpu_attention.write_kv_cache(key, value, k_cache, v_cache, cpu_attention.write_plan(slots, k_cache))
    torch.testing.assert_close(k_cache.transpose(1, 2).reshape(-1, 3, 8)[4], key[1])


def test_rotary_matches_rotate_half_bit_for_bit():
    gen = torch.Generator().manual_seed(4)
    qkv = torch.randn(5, 20, 64, generator=gen).to(torch.bfloat16)
    x = qkv[:, :12]                            # a strided slice, as the model passes q and k
    angles = torch.randn(5, 1, 32, generator=gen)
    cos = torch.cat((angles.cos(), angles.cos()), -1).to(torch.bfloat16)
    sin = torch.cat((angles.sin(), angles.sin()), -1).to(torch.bfloat16)
    rotate_half = torch.cat((-x[..., 32:], x[..., :32]), dim=-1)
    want = x * cos + rotate_half * sin
    assert torch.equal(torch_fused.apply_rotary(x, cos, sin), want)
    assert torch.equal(torch_fused.qk_norm_rope(x, cos, sin, 9), want)
    sin2 = sin * 0.5                           # a new step's sin: a new signed copy, not the cached one
    assert torch.equal(torch_fused.qk_norm_rope(x, cos, sin2, 9), x * cos + rotate_half * sin2)
