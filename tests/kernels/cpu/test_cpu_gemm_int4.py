"""The integer int4 GEMM (kernels/cpu/csrc/gemm_int4.c): int16 inputs, AVX512-VNNI dot products; and its int8-input
form for many rows (kernels/cpu/csrc/gemm_int4_s8.c: int8 steps of max|x| / 127 per row and group).

Against a float64 matmul of the exact weights the int4 pack holds: with the inputs as the kernel rounds them
(to int16 steps of max|x| / 32767 per row) the only error left is float32 summation; with the inputs as
given, each input moves by at most half a step on top. Every row count from 1 past a few 4-row tiles, the
group sizes the int4 kernels take, one input far larger than the rest (it sets the row's step), and the
switch in weight_only.int4_linear that sends calls here. Both forms give a row the same bits whatever rows run
beside it.
"""
from __future__ import annotations

import pytest
import torch

from pagedserve.common.config.dtype import cpu_has_amx_bf16
from pagedserve.kernels.cpu import dequant as cpu_dequant
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.weights import weight_only
from pagedserve.tests.helpers.kernels.int4_cases import assert_float64_close as _close, code_offsets, int4_case as _int4_case

LIB = cpu_native.library()
needs_gemm = pytest.mark.skipif(LIB is None or not LIB.ps_gemm_int4_vectorized(),
                                reason="the integer int4 GEMM needs a CPU with AVX512-VNNI and a C compiler")
needs_s8 = pytest.mark.skipif(LIB is None or not LIB.ps_gemm_int4_s8_built(),
                              reason="the int8-input form needs AVX512-VNNI and AVX512-VBMI and a C compiler")


def _gemm(x: torch.Tensor, w: weight_only.Int4Weight, threads: int = 2, kernel: str = "ps_gemm_int4") -> torch.Tensor:
    y = torch.full((x.shape[0], w.out_features), float("nan"))
    assert getattr(LIB, kernel)(w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), w.scales_and_zeros.shape[-1],
                                w.out_features, w.in_features,
                                w.group_size, x.data_ptr(), x.shape[0], y.data_ptr(), threads) == 0
    return y


def _rounded8(x: torch.Tensor, group: int) -> torch.Tensor:
    """x as the int8 form rounds it: per row and group, in its float32 order of operations."""
    parts = x.unflatten(1, (-1, group))
    top = parts.abs().amax(2, keepdim=True).double()
    inv = torch.where(top > 0, 127 / top, torch.zeros_like(top)).float()
    return (torch.round(parts * inv) * (top / 127).float()).flatten(1)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in its float32 order of operations (x * (32767 / top) rounds a value at a
    half-step boundary the other way than x / (top / 32767) may: one whole step, far above float32 sums)."""
    top = x.abs().amax(1, keepdim=True).double()
    return torch.round(x * (32767 / top).float()) * (top / 32767).float()


@needs_gemm
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 17, 64, 131, 200])
@pytest.mark.parametrize("out,cols,group", [(64, 64, 32), (192, 576, 32), (128, 256, 64), (128, 512, 128),
                                            (64, 512, 256)])
def test_int4_gemm_matches_the_weights(rows, out, cols, group):
    w, dense = _int4_case(out, cols, group, seed=rows + out + group)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, cols // 3] = 50.0                              # one outlier: row 0's step is 50 / 32767
    y = _gemm(x, w)
    _close(y, _rounded(x), dense)                       # only float32 sums differ from the rounded inputs
    _close(y, x, dense, int16_inputs=True)              # and the rounding is within half a step per input


@needs_gemm
@pytest.mark.parametrize("rows", [1, 5, 64])
def test_symmetric_groups_store_scales_alone_and_give_the_same_products(rows):
    w, dense = _int4_case(192, 576, 32, seed=rows, symmetric=True)
    assert w.scales_and_zeros.shape == (576 // 32, 192, 1)            # the zeros are not stored
    x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
    _close(_gemm(x, w), _rounded(x), dense)
    paired = weight_only.Int4Weight(w.packed, torch.cat((w.scales_and_zeros, torch.zeros_like(w.scales_and_zeros)),
                                                        -1), 32, 192, 576)
    assert torch.equal(_gemm(x, w), _gemm(x, paired))


@needs_gemm
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_threads_split_the_blocks_not_the_answer(threads):
    w, _ = _int4_case(320, 256, 32, seed=7)               # 5 blocks of 64 channels: uneven splits
    x = torch.randn(11, 256)
    assert torch.equal(_gemm(x, w, threads), _gemm(x, w, 1))


@needs_gemm
def test_a_zero_row_gives_zero_outputs_of_the_zeros_alone():
    w, dense = _int4_case(64, 64, 32, seed=3)
    x = torch.zeros(2, 64)
    x[1] = torch.randn(64)
    y = _gemm(x, w)
    assert torch.equal(y[0], torch.zeros(64))
    _close(y[1:], x[1:], dense, int16_inputs=True)


@needs_gemm
def test_int4_linear_takes_it_below_the_dense_rows():
    w, dense = _int4_case(128, 256, 64, seed=5)
    s8 = bool(LIB.ps_gemm_int4_s8_built())
    below = torch.randn((weight_only.INT4_INT8_MIN_ROWS if s8 else weight_only.int4_dense_min_rows()) - 1, 256)
    assert torch.equal(weight_only.int4_linear(below, w), _gemm(below, w))
    fewest = LIB.ps_gemm_int4_min_rows()
    assert torch.equal(weight_only.int4_linear(below[:fewest], w), _gemm(below[:fewest], w))
    for rows in range(1, fewest):                                                   # fewer: the GEMV
        assert torch.equal(weight_only.int4_linear(below[:rows], w), weight_only._int4_gemv(below[:rows], w))
    if not s8:                                  # (with the int8 form nothing widens: the test below)
        at = torch.randn(weight_only.int4_dense_min_rows(), 256)
        assert not torch.equal(weight_only.int4_linear(at, w), _gemm(at, w))            # widened + oneDNN
    # A bfloat16 caller gets bfloat16 back, and a bias is added.
    x, bias = below[:5].to(torch.bfloat16), torch.randn(128).to(torch.bfloat16)
    got = weight_only.int4_linear(x, w, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _gemm(x.float(), w).to(torch.bfloat16) + bias)


@needs_s8
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 17, 64, 131, 200, 300])
@pytest.mark.parametrize("out,cols,group", [(64, 64, 32), (192, 576, 32), (128, 256, 64), (128, 512, 128),
                                            (64, 512, 256)])
def test_int8_form_matches_the_weights(rows, out, cols, group):
    w, dense = _int4_case(out, cols, group, seed=rows + out + group, symmetric=group == 32)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, cols // 3] = 50.0                              # one outlier: it sets its group's step alone
    y = _gemm(x, w, kernel="ps_gemm_int4_s8")
    _close(y, _rounded8(x, group), dense, offsets=code_offsets(w))  # only float32 sums differ from the rounded x
    _close(y, x, dense, int8_group=group, offsets=code_offsets(w))  # and rounding moves x half a step at most


@needs_gemm
@pytest.mark.parametrize("kernel", ["ps_gemm_int4", "ps_gemm_int4_s8"])
def test_a_row_gets_the_same_bits_whatever_rows_run_beside_it(kernel):
    """What a speculative verify pass of k + 1 rows needs: each row exactly as a one-row call computes it.
    Rows 1-3 take the GEMV form where the build has one, 4 and more the tile, past 256 rows (int8 form) a
    second pass over the groups."""
    if not getattr(LIB, "ps_gemm_int4_s8_built")() and kernel == "ps_gemm_int4_s8":
        pytest.skip("no int8-input form in this build")
    for group in (32, 128):
        w, _ = _int4_case(192, 512, group, seed=group, symmetric=group == 32)
        gen = torch.Generator().manual_seed(group)
        x = torch.randn(270, 512, generator=gen) * torch.rand(270, 1, generator=gen) * 4
        alone = torch.cat([_gemm(x[r:r + 1].contiguous(), w, kernel=kernel) for r in range(x.shape[0])])
        for rows in (2, 3, 4, 5, 7, 9, 64, 257, 270):
            assert torch.equal(_gemm(x[:rows].contiguous(), w, kernel=kernel), alone[:rows]), (group, rows)


@needs_s8
def test_int4_linear_takes_the_int8_form_from_its_rows_and_never_widens():
    # more weights than INT4_AMX_DENSE_MAX_WEIGHTS: with AMX-BF16 smaller weights widen (the test below)
    cols = 2048
    w, _ = _int4_case(weight_only.INT4_AMX_DENSE_MAX_WEIGHTS // cols + 64, cols, 64, seed=9)
    at = weight_only.INT4_INT8_MIN_ROWS
    x = torch.randn(at + 40, cols)
    assert weight_only.int4_dense_min_rows() == weight_only.INT4_NEVER_DENSE
    assert torch.equal(weight_only.int4_linear(x[:at], w), _gemm(x[:at].contiguous(), w, kernel="ps_gemm_int4_s8"))
    assert torch.equal(weight_only.int4_linear(x, w), _gemm(x, w, kernel="ps_gemm_int4_s8"))
    below = x[:at - 1].contiguous()                                       # below it: the int16 form
    assert torch.equal(weight_only.int4_linear(below, w), _gemm(below, w))
    assert not torch.equal(_gemm(below, w), _gemm(below, w, kernel="ps_gemm_int4_s8"))


def test_the_int8_form_declines_shapes_it_does_not_take():
    if LIB is None:
        pytest.skip("no C compiler")
    w, _ = _int4_case(64, 64, 32, seed=1)
    x, y = torch.randn(2, 64), torch.empty(2, 96)
    # n not a multiple of 64, and no rows: 2 (the caller keeps its other paths), never a crash
    assert LIB.ps_gemm_int4_s8(w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), 2, 96, 64, 32, x.data_ptr(), 2,
                               y.data_ptr(), 2) == 2
    assert LIB.ps_gemm_int4_s8(w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), 2, 64, 64, 32, x.data_ptr(), 0,
                               y.data_ptr(), 2) == 2


needs_amx = pytest.mark.skipif(LIB is None or not LIB.ps_gemm_int4_s8_amx(),
                               reason="the AMX tile needs a CPU with AMX-INT8 and a kernel that grants it")


@needs_s8
@pytest.mark.skipif(not cpu_has_amx_bf16(), reason="oneDNN's AMX-BF16 path needs a CPU with AMX-BF16")
def test_with_amx_bf16_narrow_weights_widen_from_the_int8_forms_rows():
    """Up to INT4_AMX_DENSE_MAX_WEIGHTS a many-row call widens the weight and runs oneDNN's bfloat16 matmul;
    fewer rows keep the int16 GEMM, bigger weights the int8-input GEMM."""
    at = weight_only.INT4_INT8_MIN_ROWS
    w, _ = _int4_case(weight_only.INT4_AMX_DENSE_MAX_WEIGHTS // 256, 256, 32, seed=4, symmetric=True)
    assert weight_only.int4_dense_min_rows(w) == at
    x = torch.randn(at, 256)
    widened = torch.mm(x.to(torch.bfloat16), cpu_dequant.int4_to_bf16_t(w.packed, w.scales_and_zeros, w.out_features,
                                                                        w.in_features, w.group_size)).float()
    assert torch.equal(weight_only.int4_linear(x, w), widened)
    assert torch.equal(weight_only.int4_linear(x[:at - 1].contiguous(), w), _gemm(x[:at - 1].contiguous(), w))
    wide, _ = _int4_case(weight_only.INT4_AMX_DENSE_MAX_WEIGHTS // 256 + 64, 256, 32, seed=5, symmetric=True)
    assert weight_only.int4_dense_min_rows(wide) == weight_only.INT4_NEVER_DENSE


@needs_amx
@pytest.mark.parametrize("rows", [16, 17, 31, 32, 33, 100, 300])
@pytest.mark.parametrize("out,cols,group,symmetric", [(64, 64, 32, True), (192, 576, 32, True),
                                                      (128, 256, 64, False), (128, 512, 128, False),
                                                      (64, 512, 256, True), (960, 960, 32, True)])
def test_the_amx_tile_gives_the_vnni_tiles_bits(rows, out, cols, group, symmetric):
    """gemm_int4_amx.c: the same int32 group sums and the same float operations per row and group as the VNNI
    tile, so every output to the bit; rows padded to the tile's 32 and never written past `rows`."""
    w, dense = _int4_case(out, cols, group, seed=rows + out + group, symmetric=symmetric)
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, cols, generator=gen) * torch.rand(rows, 1, generator=gen) * 4
    x[0, cols // 3] = 50.0
    amx = _gemm(x, w, kernel="ps_gemm_int4_s8")
    assert torch.equal(amx, _gemm(x, w, kernel="ps_gemm_int4_s8_vnni"))
    _close(amx, _rounded8(x, group), dense, offsets=code_offsets(w))

