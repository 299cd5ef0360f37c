"""The integer int4 GEMM (kernels/csrc/gemm_int4.c): int16 inputs, AVX512-VNNI dot products.

Against a float64 matmul of the exact weights the int4 pack holds: with the inputs as the kernel rounds them
(to int16 steps of max|x| / 32767 per row) the only error left is float32 summation; with the inputs as
given, each input moves by at most half a step on top. Every row count from 1 past a few 4-row tiles, the
group sizes the int4 kernels take, one input far larger than the rest (it sets the row's step), and the
switch in weight_only.int4_linear that sends calls here.
"""
from __future__ import annotations

import pytest
import torch

from pagedserve.kernels import cpu_native, weight_only
from pagedserve.tests.helpers.int4_cases import assert_float64_close as _close, int4_case as _int4_case

LIB = cpu_native.library()
needs_gemm = pytest.mark.skipif(LIB is None or not LIB.ps_gemm_int4_vectorized(),
                                reason="the integer int4 GEMM needs a CPU with AVX512-VNNI and a C compiler")


def _gemm(x: torch.Tensor, w: weight_only.Int4Weight, threads: int = 2) -> torch.Tensor:
    y = torch.full((x.shape[0], w.out_features), float("nan"))
    assert LIB.ps_gemm_int4(w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), w.scales_and_zeros.shape[-1],
                            w.out_features, w.in_features,
                            w.group_size, x.data_ptr(), x.shape[0], y.data_ptr(), threads) == 0
    return y


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it, in its float32 order of operations (x * (32767 / top) rounds a value at a
    half-step boundary the other way than x / (top / 32767) may: one whole step, far above float32 sums)."""
    top = x.abs().amax(1, keepdim=True).double()
    return torch.round(x * (32767 / top).float()) * (top / 32767).float()


@needs_gemm
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 7, 8, 9, 13, 64, 131])
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
    below = torch.randn(weight_only.int4_dense_min_rows() - 1, 256)
    assert torch.equal(weight_only.int4_linear(below, w), _gemm(below, w))
    fewest = LIB.ps_gemm_int4_min_rows()
    assert torch.equal(weight_only.int4_linear(below[:fewest], w), _gemm(below[:fewest], w))
    for rows in range(1, fewest):                                                   # fewer: the GEMV
        assert torch.equal(weight_only.int4_linear(below[:rows], w), weight_only._int4_gemv(below[:rows], w))
    at = torch.randn(weight_only.int4_dense_min_rows(), 256)
    assert not torch.equal(weight_only.int4_linear(at, w), _gemm(at, w))                # widened + oneDNN
    # A bfloat16 caller gets bfloat16 back, and a bias is added.
    x, bias = below[:5].to(torch.bfloat16), torch.randn(128).to(torch.bfloat16)
    got = weight_only.int4_linear(x, w, bias)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _gemm(x.float(), w).to(torch.bfloat16) + bias)
