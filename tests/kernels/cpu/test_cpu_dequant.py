"""The CPU widen-then-dense path for many-row steps (kernels/cpu/csrc/dequant.c, kernels/weights/weight_only.py).

Widening must reproduce the packed kernels' own weights bit for bit (the int4 kernel's weight read back
through an identity input; int8 codes times their bfloat16 scale), and a layer that takes the dense path
must meet the same dequantize-then-matmul bound as the packed kernels (tests/executor/model/quant/test_quantized_linear.py): on
top of that test's bfloat16 terms the dense path rounds each widened weight to bfloat16 once more (relative
2**-9), which stays inside its 1e-2 * (|x| @ |W|^T).
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize

from pagedserve.common.config.dtype import cpu_has_native_bf16
from pagedserve.executor.model.quant.gguf_blocks import decode_gguf_tensor
from pagedserve.executor.model.layers.linear_method import apply_linear
from pagedserve.executor.model.quant.packing import pack_linear
from pagedserve.kernels.cpu import dequant as cpu_dequant
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.weights.weight_only import (INT4_NEVER_DENSE, INT8_DENSE_BLOCK_ROWS, INT8_DENSE_MIN_ROWS, Int4Weight,
                                            Int8Weight, dense_path, int4_dense_min_rows, int4_linear, int8_linear,
                                            pack_int4, quantize_int8)

CPU = torch.device("cpu")
needs_kernels = pytest.mark.skipif(cpu_native.library() is None, reason="no C compiler on this machine")
needs_dense = pytest.mark.skipif(cpu_native.library() is None or not cpu_has_native_bf16(),
                                 reason="the dense path runs on CPUs with native bfloat16 and a C compiler")


def _int4(out: int, cols: int, group: int, seed: int, symmetric: bool = False) -> Int4Weight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, cols), generator=g, dtype=torch.uint8)
    scale = torch.rand(out, cols // group, generator=g) * 0.02
    zero = torch.zeros(out, cols // group) if symmetric else torch.randn(out, cols // group, generator=g) * 0.02
    return pack_int4(q, scale, zero, group, CPU)


@needs_kernels
@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("out,cols,group", [(64, 128, 32), (192, 256, 64), (128, 512, 128), (64, 512, 256)])
def test_int4_widening_is_the_packed_kernels_own_weight(out, cols, group, symmetric):
    w = _int4(out, cols, group, seed=out + cols, symmetric=symmetric)
    eye = torch.eye(cols, dtype=torch.bfloat16)
    pairs = w.scales_and_zeros                                   # symmetric packs hold scales alone: torch's
    if pairs.shape[-1] == 1:                                     # kernel wants the zeros beside them
        pairs = torch.cat((pairs, torch.zeros_like(pairs)), -1)
    kernels_weight = torch._weight_int4pack_mm_for_cpu(eye, w.packed, group, pairs)   # [cols, out]
    widened = cpu_dequant.int4_to_bf16_t(w.packed, w.scales_and_zeros, out, cols, group)
    assert widened.shape == (cols, out)
    assert torch.equal(widened, kernels_weight)


@needs_kernels
@pytest.mark.parametrize("first,last", [(0, 300), (17, 250), (299, 300), (5, 5)])
@pytest.mark.parametrize("chunk", [32, 16, 24, 96])
def test_int8_row_widening_is_codes_times_scales(first, last, chunk):
    """Chunks of Q8_0 (32) and Q6_K (16) columns, one (24) with a tail past the 16-wide vector form, whole rows;
    rounded to bfloat16 as torch rounds."""
    w = quantize_int8(torch.randn(300, 96) * torch.rand(1, 96) * 4, chunk=chunk)
    widened = cpu_dequant.int8_rows_to_bf16(w.q, w.scale, first, last)
    rows = (w.q.float() * w.scale.float().unsqueeze(-1)).movedim(0, 1).reshape(300, 96)[first:last]
    assert torch.equal(widened, rows.to(torch.bfloat16))


@needs_kernels
def test_widening_refuses_what_it_would_misread():
    w = _int4(64, 128, 32, seed=1)
    with pytest.raises(ValueError, match="scales_and_zeros must be a contiguous CPU torch.bfloat16"):
        cpu_dequant.int4_to_bf16_t(w.packed, w.scales_and_zeros.float(), 64, 128, 32)
    with pytest.raises(ValueError, match="do not match"):
        cpu_dequant.int4_to_bf16_t(w.packed, w.scales_and_zeros, 128, 128, 32)
    q8 = quantize_int8(torch.randn(10, 64), chunk=32)
    with pytest.raises(ValueError, match="q must be a contiguous CPU torch.int8 tensor, got torch.int8 strided"):
        cpu_dequant.int8_rows_to_bf16(q8.q.transpose(1, 2), q8.scale, 0, 10)
    with pytest.raises(ValueError, match="row range 4..11 is not within 0..10"):
        cpu_dequant.int8_rows_to_bf16(q8.q, q8.scale, 4, 11)


def _gguf(qtype: T, rows: int, cols: int) -> tuple:
    rng = np.random.default_rng(int(qtype))
    w = decode_gguf_tensor(quantize(rng.standard_normal((rows, cols)).astype(np.float32) * 0.05, qtype),
                           qtype, (rows, cols))
    return w, pack_linear([(0, w)], rows, "gguf", CPU, torch.float32, "test")


# Where the int4 GEMM has int8 inputs no int4 call widens (weight_only.INT4_NEVER_DENSE); the switch itself is
# tested below with an explicit threshold.
_INT4_ROWS = int4_dense_min_rows()
_int4_widens = pytest.mark.skipif(_INT4_ROWS == INT4_NEVER_DENSE, reason="the int8-input int4 GEMM takes every row count")


@needs_dense
@pytest.mark.parametrize("qtype,kind,batch", [pytest.param(T.Q4_1, Int4Weight, _INT4_ROWS + 9, marks=_int4_widens),
                                              pytest.param(T.Q4_0, Int4Weight, 2 * _INT4_ROWS, marks=_int4_widens),
                                              (T.Q8_0, Int8Weight, INT8_DENSE_MIN_ROWS + 3)])
def test_many_rows_take_the_dense_path_within_the_packed_bound(qtype, kind, batch):
    w, packed = _gguf(qtype, 128, 512)
    assert isinstance(packed, kind)
    x = torch.randn(batch, 512, generator=torch.Generator().manual_seed(batch))
    y = apply_linear(x, packed).float()
    if kind is Int4Weight:
        dense = x.to(torch.bfloat16) @ cpu_dequant.int4_to_bf16_t(packed.packed, packed.scales_and_zeros, 128,
                                                                  512, packed.group_size)
    else:
        dense = x.to(torch.bfloat16) @ cpu_dequant.int8_rows_to_bf16(packed.q, packed.scale, 0, 128).t()
    assert torch.equal(y, dense.float())                # it did take the dense path
    ref_w = w.dequantize()
    ref, bound = x @ ref_w.T, 1e-2 * (x.abs() @ ref_w.abs().T)
    if kind is Int8Weight:
        bound = bound + (ref_w.abs().amax(1) / 254)[None, :] * x.abs().sum(1, keepdim=True)
    assert (y - ref).abs().le(bound + 1e-6).all(), float(((y - ref).abs() - bound).max())


@needs_dense
def test_the_switch_is_by_rows_and_both_sides_agree():
    w = _int4(128, 256, 64, seed=3)
    at = 64
    x = torch.randn(at, 256)
    assert dense_path(x, at) and not dense_path(x[:-1], at)
    packed_y = int4_linear(x, w, dense_min_rows=10 ** 9)
    dense_y = int4_linear(x, w, dense_min_rows=at)
    assert not torch.equal(packed_y, dense_y)            # two different kernels ran
    # Both sides within rounding of the weights' own product: bfloat16 inputs and weights on the dense side
    # (relative 2**-8 each), and up to half an int8 step an input (max |x| / 254 per group of 64) on the
    # packed side where the integer GEMM has int8 inputs.
    weight = cpu_dequant.int4_to_bf16_t(w.packed, w.scales_and_zeros, 128, 256, 64).float()
    ref = x.double() @ weight.double()
    steps = x.abs().unflatten(1, (-1, 64)).amax(2).repeat_interleave(64, 1) / 254
    bound = 1e-2 * (x.abs() @ weight.abs()) + steps @ weight.abs() + 1e-5
    for y in (packed_y, dense_y, int4_linear(x[:1], w)):         # one row: either side of the switch too
        assert ((y.double() - ref[:y.shape[0]]).abs() <= bound[:y.shape[0]]).all()


@needs_dense
def test_a_tall_int8_weight_is_widened_in_blocks():
    rows = INT8_DENSE_BLOCK_ROWS + 700                                        # a block and a remainder
    w = quantize_int8(torch.randn(rows, 64), chunk=32)
    x = torch.randn(INT8_DENSE_MIN_ROWS, 64)
    y = int8_linear(x, w)
    whole = x.to(torch.bfloat16) @ cpu_dequant.int8_rows_to_bf16(w.q, w.scale, 0, rows).t()
    # Blocks and the whole matrix may run different oneDNN kernels: equal up to one bfloat16 rounding.
    torch.testing.assert_close(y, whole.float(), rtol=2 ** -7, atol=1e-3)
    assert (y[:, INT8_DENSE_BLOCK_ROWS:] != 0).all()                         # the remainder was written
