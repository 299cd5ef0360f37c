"""Every Triton kernel against the PyTorch reference on random inputs (CPU: TRITON_INTERPRET=1, small shapes)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before the kernel modules are imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from pagedserve.kernels import torch_fused
from pagedserve.kernels.attention import reference as attention_reference  # noqa: E402
from pagedserve.kernels.attention import triton_paged as triton_attention
from pagedserve.kernels.attention import triton_cache
from pagedserve.kernels.triton import fused as triton_fused
from pagedserve.kernels.triton import gemm as triton_gemm  # noqa: E402
from pagedserve.tests.helpers.kernels.attention_cases import make_batch  # noqa: E402
from pagedserve.tests.helpers.kernels.kernel_checks import DEVICE, rel_err, run_both, to_device  # noqa: E402

MIXED = [(1 + (7 * i) % 45, 1) for i in range(5)] + [(20, 20), (50, 13), (9, 2), (33, 17)]


@pytest.mark.parametrize("block_size", [8, 16, 32])
@pytest.mark.parametrize("hq,hkv", [(2, 2), (6, 2), (8, 2)])       # GQA ratios 1, 3, 4
def test_attention_mixed_batch(block_size, hq, hkv):
    out, ref = run_both(MIXED, block_size, hq, hkv, 64, seed=block_size + hq)
    assert rel_err(out, ref) < 1e-3


def test_attention_multi_token_decodes():
    """Decodes of several query tokens each (a draft being verified, meta.decode_query_len > 1) beside a
    prefill: causal inside each draft, against the reference."""
    gen = torch.Generator().manual_seed(11)
    k_cache, v_cache, _, meta = make_batch([(30, 4), (17, 4), (50, 4), (20, 20)], 16, 2, 64, gen)
    meta.num_decodes, meta.decode_query_len = 3, 4
    q = torch.randn(meta.query_start_loc_cpu[-1], 6, 64, generator=gen)
    ref = attention_reference.paged_attention(q, k_cache, v_cache, meta, 0.125)
    out = triton_attention.paged_attention(q.to(DEVICE), k_cache.to(DEVICE), v_cache.to(DEVICE), to_device(meta),
                                           0.125)
    assert rel_err(out.float().cpu(), ref) < 1e-3


@pytest.mark.parametrize("num_splits", [1, 4])
def test_attention_decodes_split_kv(num_splits):
    seqs = [(n, 1) for n in (1, 17, 64, 100, 150)]
    out, ref = run_both(seqs, 16, 6, 2, 64, seed=3, num_splits=num_splits)
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("window,softcap", [(1, None), (10, None), (70, None), (None, 0.3), (37, 1.0)])
def test_attention_sliding_window_and_softcap(window, softcap):
    # windows inside one 64-token tile, across tiles (whole tiles skipped), longer than every context
    out, ref = run_both([(5, 1), (90, 1), (150, 1), (20, 20), (140, 70)], 16, 6, 2, 32, seed=11,
                        window=window, softcap=softcap)
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("num_splits", [1, 4])
def test_attention_sliding_window_decodes_split_kv(num_splits):
    seqs = [(n, 1) for n in (1, 17, 64, 100, 200)]
    out, ref = run_both(seqs, 16, 4, 2, 32, seed=12, num_splits=num_splits, window=24)
    assert rel_err(out, ref) < 1e-3


def test_attention_shared_prefix_blocks_and_continuation():
    # Three sequences share their first two blocks (a prefix hit); two continue a prompt past it.
    seqs = [(40, 1), (45, 13), (70, 30)]
    out, ref = run_both(seqs, 16, 4, 1, 64, seed=5, share_prefix=2)
    assert rel_err(out, ref) < 1e-3


def test_attention_head_dim_128_and_padding_head_dim():
    out, ref = run_both([(30, 1), (25, 9)], 16, 4, 2, 128, seed=7)
    assert rel_err(out, ref) < 1e-3
    out, ref = run_both([(30, 1), (25, 9)], 16, 4, 2, 48, seed=8)     # not a power of two: masked lanes
    assert rel_err(out, ref) < 1e-3


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_attention_half_precision(dtype):
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        pytest.skip("the Triton interpreter multiplies bf16 dot operands as raw bits; checked on GPU")
    out, ref = run_both([(30, 1), (64, 1), (25, 9)], 16, 6, 2, 64, seed=9, dtype=dtype)
    assert rel_err(out, ref) < 2e-2


def test_write_kv_cache_matches_reference_and_skips_padding():
    gen = torch.Generator().manual_seed(0)
    blocks, hkv, bs, d = 6, 3, 8, 64
    key = torch.randn(10, hkv + 1, d, generator=gen)[:, :hkv]        # strided, like a slice of qkv
    value = torch.randn(10, hkv, d, generator=gen)
    slots = torch.tensor([3, -1, 9, 40, -1, 15, 47, 0, -1, 22])
    sentinel = 1234.5
    ref_k, ref_v = (torch.full((blocks, hkv, bs, d), sentinel) for _ in range(2))
    attention_reference.write_kv_cache(key, value, ref_k, ref_v, slots)
    k_cache, v_cache = (torch.full((blocks, hkv, bs, d), sentinel, device=DEVICE) for _ in range(2))
    triton_cache.write_kv_cache(key.to(DEVICE), value.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    torch.testing.assert_close(k_cache.cpu(), ref_k, rtol=0, atol=0)
    torch.testing.assert_close(v_cache.cpu(), ref_v, rtol=0, atol=0)
    written = {3, 9, 40, 15, 47, 0, 22}
    flat = k_cache.cpu().transpose(1, 2).reshape(blocks * bs, hkv, d)
    untouched = [s for s in range(blocks * bs) if s not in written]
    assert bool((flat[untouched] == sentinel).all())          # padding (-1) rows went nowhere


@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(with_residual):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(7, 96, generator=gen)
    w = torch.randn(96, generator=gen)
    res = torch.randn(7, 96, generator=gen) if with_residual else None
    ref = torch_fused.rms_norm(x, w, 1e-6, res)
    out = triton_fused.rms_norm(x.to(DEVICE), w.to(DEVICE), 1e-6, res.to(DEVICE) if with_residual else None)
    if with_residual:
        assert rel_err(out[0].cpu(), ref[0]) < 1e-5 and rel_err(out[1].cpu(), ref[1]) < 1e-6
    else:
        assert rel_err(out.cpu(), ref) < 1e-5


def test_silu_and_mul():
    x = torch.randn(5, 2 * 300, generator=torch.Generator().manual_seed(2))
    assert rel_err(triton_fused.silu_and_mul(x.to(DEVICE)).cpu(), torch_fused.silu_and_mul(x)) < 1e-5


@pytest.mark.parametrize("with_norm", [False, True])
def test_qk_norm_rope(with_norm):
    gen = torch.Generator().manual_seed(3)
    tokens, hq, hkv, d = 6, 4, 2, 64
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=gen)
    qk = qkv[:, :(hq + hkv) * d].view(tokens, hq + hkv, d)              # strided view, as in the model
    angles = torch.rand(tokens, d // 2, generator=gen) * 10
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    qw, kw = (torch.randn(d, generator=gen), torch.randn(d, generator=gen)) if with_norm else (None, None)
    ref = torch_fused.qk_norm_rope(qk, cos, sin, hq, qw, kw, 1e-6)
    dev = (lambda t: t.to(DEVICE) if t is not None else None)
    out = triton_fused.qk_norm_rope(dev(qkv)[:, :(hq + hkv) * d].view(tokens, hq + hkv, d), dev(cos), dev(sin),
                                    hq, dev(qw), dev(kw), 1e-6)
    assert rel_err(out.cpu(), ref) < 1e-5


@pytest.mark.parametrize("rows,n,k,bias", [(1, 40, 300, False), (3, 100, 128, True), (16, 33, 520, True)])
def test_skinny_gemm(rows, n, k, bias):
    gen = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, k + 8, generator=gen)[:, :k]            # strided rows, as after a gather
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = torch.nn.functional.linear(x, w, b)
    dev = (lambda t: t.to(DEVICE) if t is not None else None)
    assert rel_err(triton_gemm.skinny_gemm(dev(x), dev(w), dev(b)).cpu(), want) < 1e-5
