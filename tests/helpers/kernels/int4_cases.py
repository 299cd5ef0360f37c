"""A packed int4 weight with the float64 weight it holds, and the bound a float32 GEMV/GEMM of it must meet,
shared by the C GEMV and the int4 GEMM tests."""
from __future__ import annotations

import torch

from pagedserve.kernels.weights import weight_only


def int4_case(out: int, cols: int, group: int, seed: int,
              symmetric: bool = False) -> tuple[weight_only.Int4Weight, torch.Tensor]:
    """A packed int4 weight and the float64 weight it holds ((q - 8) * scale + zero, scales in bfloat16).
    symmetric: every zero 0 (GGUF Q4_0), which the CPU pack stores as scales alone where our kernels run."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 16, (out, cols), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out, cols // group, generator=gen) * 0.1
    zero = torch.randn(out, cols // group, generator=gen) * 0.1
    if symmetric:
        zero = torch.zeros_like(zero)
    w = weight_only.pack_int4(q, scale, zero, group, "cpu")
    s64, z64 = (t.to(torch.bfloat16).double().repeat_interleave(group, 1) for t in (scale, zero))
    return w, (q.double() - 8) * s64 + z64


def code_offsets(w: weight_only.Int4Weight) -> torch.Tensor:
    """[out, cols] float64: 8 * |scale| per weight, the size of the terms the integer GEMMs cancel. They sum
    codes 0..15 times the inputs and subtract 8 * scale * sum(x) per group, so an output whose weights are
    near 0 (codes near 8) still carries float32 rounding of those terms' size."""
    scales = w.scales_and_zeros[..., 0].double().abs().t()                 # [out, groups]
    return 8 * scales.repeat_interleave(w.group_size, 1)


def assert_float64_close(y: torch.Tensor, x: torch.Tensor, dense: torch.Tensor, int16_inputs: bool = False,
                         int8_group: int = 0, offsets: torch.Tensor | None = None) -> None:
    # float32 sums of float32 products: the error is a few ulps of sum |x * w| per output (plus the cancelled
    # offset terms' size where given: code_offsets). The int8 kernel rounds x to int16 steps of
    # max|x| / 32767 first, the int4 GEMM's int8 form to int8 steps of max|x| / 127 per group of int8_group
    # inputs: each input moves by at most half a step.
    magnitude = dense.abs() if offsets is None else dense.abs() + offsets
    bound = (x.double().abs() @ magnitude.t()) * 1e-5 + 1e-6
    if int16_inputs:
        bound += x.double().abs().amax(1, keepdim=True) / 65534 * dense.abs().sum(1)
    if int8_group:
        tops = x.double().abs().unflatten(1, (-1, int8_group)).amax(2).repeat_interleave(int8_group, 1)
        bound += (tops / 254) @ dense.abs().t()
    assert ((y.double() - x.double() @ dense.t()).abs() <= bound).all()
