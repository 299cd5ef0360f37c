"""Widening packed int4 / int8 weights to bfloat16 on CPU (kernels/cpu/csrc/dequant.c, loaded by cpu_native)."""
from __future__ import annotations

import torch

from pagedserve.kernels.cpu.int4_pack import pack_layout
from pagedserve.kernels.cpu.native import SZ_K, check, int4_sz_form, library, threads_for

# Weights per thread below which a second thread does not pay (measured: a 576x576 int4 weight widens in
# 0.065 ms on one thread and 0.086 on two; 576x3072 in 0.34 and 0.27; measured on the pthread pool that
# kernels/cpu/csrc/parallel.c replaced, whose wakes cost more than OpenMP's: a lower bound may pay now).
MIN_WEIGHTS_PER_THREAD = 1 << 19


def _expect(t: torch.Tensor, dtype: torch.dtype, name: str) -> None:
    # The C side reads raw memory: a strided view or another dtype would be read as garbage.
    if t.dtype != dtype or not t.is_contiguous() or t.device.type != "cpu":
        raise ValueError(f"{name} must be a contiguous CPU {dtype} tensor, got {t.dtype} "
                         f"{'contiguous' if t.is_contiguous() else 'strided'} on {t.device}")


def int4_to_bf16_t(packed: torch.Tensor, scales_and_zeros: torch.Tensor, out_features: int, in_features: int,
                   group_size: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight of torch's CPU int4 pack, widened and transposed: bfloat16 [in_features, out_features].
    scales_and_zeros: bfloat16 [groups, out_features, 2], or [groups, out_features, 1] for scales alone (zeros 0),
    or the K form's int16 words (cpu_native.SZ_K)."""
    lib = library()
    if lib is None:
        raise RuntimeError("cpu kernels are unavailable (no C compiler)")
    _expect(packed, torch.uint8, "packed")
    form = int4_sz_form(scales_and_zeros)
    _expect(scales_and_zeros, torch.int16 if form == SZ_K else torch.bfloat16, "scales_and_zeros")
    if out is None:
        out = torch.empty(in_features, out_features, dtype=torch.bfloat16)
    _expect(out, torch.bfloat16, "out")
    if packed.numel() != out_features * in_features // 2 or out.numel() != out_features * in_features:
        raise ValueError(f"int4 widening: sizes do not match a [{out_features}, {in_features}] weight")
    check(lib.ps_dequant_int4_t(packed.data_ptr(), scales_and_zeros.data_ptr(), form, pack_layout(),
                                 out.data_ptr(), out_features, in_features, group_size, threads_for(out.numel(), MIN_WEIGHTS_PER_THREAD)),
          "int4 widening")
    return out


def int8_rows_to_bf16(q: torch.Tensor, scale: torch.Tensor, first: int, last: int,
                      out: torch.Tensor | None = None) -> torch.Tensor:
    """Rows first..last-1 of an int8 weight (q [chunks, rows, chunk], scale [chunks, rows]), widened:
    bfloat16 [last - first, chunks * chunk]."""
    lib = library()
    if lib is None:
        raise RuntimeError("cpu kernels are unavailable (no C compiler)")
    _expect(q, torch.int8, "q")
    _expect(scale, torch.bfloat16, "scale")
    chunks, rows, chunk = q.shape
    if not 0 <= first <= last <= rows:
        raise ValueError(f"int8 widening: row range {first}..{last} is not within 0..{rows}")
    if out is None:
        out = torch.empty(last - first, chunks * chunk, dtype=torch.bfloat16)
    _expect(out, torch.bfloat16, "out")
    if scale.shape != (chunks, rows) or out.shape != (last - first, chunks * chunk):
        raise ValueError("int8 widening: scale or out does not match q's shape and the row range")
    check(lib.ps_dequant_int8_rows(q.data_ptr(), scale.data_ptr(), out.data_ptr(), chunks, rows, chunk, first,
                                    last, threads_for(out.numel(), MIN_WEIGHTS_PER_THREAD)), "int8 widening")
    return out
