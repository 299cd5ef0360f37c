"""5- and 6-bit weight-only linears on CPU: GGUF's Q5_0 / Q5_1 / Q5_K / Q6_K layers at their own width.

They went to int8 per output channel before (8 bits a weight where the file holds 5.5-6.6), and llama-quantize
writes most of a Q4_K_M file's layers as Q5_0 wherever a width is not a multiple of 256 (the 135M and 360M
ladder models): a batch-1 token read a third more bytes than the file has. `IntNWeight` keeps each code's
bits: the low four in torch's int4 pack, the rest as bit planes, one record per 64 channels and pair of
input columns (kernels/cpu/csrc/gemm_intn.h describes it). Calls of up to INTN_DENSE_MIN_ROWS - 1 rows run the
integer GEMM of kernels/cpu/csrc/gemm_intn.c (int16 inputs, as the int4 GEMM rounds them); more rows widen the
weight to bfloat16 once for oneDNN where the CPU has native bfloat16. The form needs AVX512-VNNI, -VBMI and
-BW (`intn_built`); elsewhere the loader keeps such layers as int8.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.dequant import MIN_WEIGHTS_PER_THREAD
from pagedserve.kernels.weights.weight_only import GEMV_MIN_WEIGHTS_PER_THREAD, dense_path

INTN_BITS = (5, 6)
# Rows from which a call widens the weight for oneDNN on a CPU with native bfloat16: the integer GEMM's time
# grows with the rows (four a pass over the codes), widening's is paid once per call. The GEMM's time over
# widening's, 2 threads (docs/cpu_performance.md, 2026-11-28 evening): 5-bit 0.56-0.68x at 32 rows and
# 0.95-1.21x at 64 on the 135M/360M shapes, 0.30-0.34x at 64 on the 1.7B model's; 6-bit in groups of 16 (Q6_K)
# 0.75-0.96x at 32 and 1.26-1.59x at 64 on the small shapes, 0.51x at 64 on the 1.7B MLP's.
INTN_DENSE_MIN_ROWS = 64


@dataclass
class IntNWeight:
    packed: torch.Tensor             # uint8 [out / 64, in / 2, 64 + 16 * (bits - 4)] (gemm_intn.h)
    scales_and_zeros: torch.Tensor   # bfloat16 [in / group, out, 2]: (scale, zero), [.., 1] where zeros are all 0
    bits: int
    group_size: int
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_and_zeros))


@functools.lru_cache(maxsize=1)
def intn_built() -> bool:
    """Whether this machine's build of the C kernels has the 5/6-bit GEMM."""
    lib = cpu_native.library()
    return lib is not None and bool(lib.ps_gemm_intn_built())


def intn_fits(out: int, cols: int, bits: int, group_size: int) -> bool:
    return bits in INTN_BITS and out % 64 == 0 and group_size % 2 == 0 and group_size > 0 and cols % group_size == 0


def intn_nbytes(out: int, cols: int, bits: int, group_size: int, zeros: bool) -> int:
    """The pack's bytes: the codes, and a bfloat16 scale (and zero, where any is not 0) per group and channel."""
    return out * cols * bits // 8 + out * (cols // group_size) * 2 * (2 if zeros else 1)


def _plane(bit: torch.Tensor) -> torch.Tensor:
    """One bit of every code, uint8 [out, in] of 0/1, as gemm_intn.h's plane: per block and pair of columns four
    little-endian uint32, word c's bit 2j + t from channel 16c + j at column 2i + t: [out / 64, in / 2, 16]."""
    out, cols = bit.shape
    b = bit.view(out // 64, 4, 16, cols // 2, 2).permute(0, 3, 1, 2, 4)        # [blocks, pairs, c, j, t]
    b = b.reshape(out // 64, cols // 2, 4, 4, 8).to(torch.int32)                # [.., c, byte of the word, bit]
    weights = torch.tensor([1 << i for i in range(8)], dtype=torch.int32)
    return (b * weights).sum(-1).to(torch.uint8).reshape(out // 64, cols // 2, 16)


def pack_intn(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, bits: int, group_size: int) -> IntNWeight:
    """q uint8 [out, in] codes 0..2^bits - 1, scale / zero float [out, in // group_size]:
    w = (q - 2^(bits-1)) * scale + zero."""
    out, cols = q.shape
    if not intn_fits(out, cols, bits, group_size):
        raise ValueError(f"the {bits}-bit pack takes {INTN_BITS} bits, out features a multiple of 64 and an even "
                         f"group size dividing the input features: got [{out}, {cols}] in groups of {group_size}")
    if int(q.max()) >= 1 << bits:
        raise ValueError(f"codes up to {int(q.max())} do not fit {bits} bits")
    q = q.to(torch.uint8)
    low = (q & 15).view(out // 64, 2, 32, cols)
    nibbles = (low[:, 0] | (low[:, 1] << 4)).transpose(1, 2).reshape(out // 64, cols // 2, 64)
    planes = [_plane((q >> (4 + b)) & 1) for b in range(bits - 4)]
    packed = torch.cat([nibbles, *planes], -1).contiguous()
    sz = torch.stack((scale.float(), zero.float()), -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    if not bool(sz[..., 1].any()):
        sz = sz[..., :1].contiguous()
    return IntNWeight(packed, sz, bits, group_size, out, cols)


def intn_to_bf16_t(w: IntNWeight) -> torch.Tensor:
    """The weight widened and transposed by the C kernel: bfloat16 [in, out]."""
    out = torch.empty(w.in_features, w.out_features, dtype=torch.bfloat16)
    cpu_native.check(cpu_native.library().ps_dequant_intn_t(
        w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), w.scales_and_zeros.shape[-1], w.bits, out.data_ptr(),
        w.out_features, w.in_features, w.group_size,
        cpu_native.threads_for(out.numel(), MIN_WEIGHTS_PER_THREAD)), "5/6-bit widening")
    return out


def _intn_gemm(x2: torch.Tensor, w: IntNWeight) -> torch.Tensor:
    x2 = x2.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], w.out_features, dtype=torch.float32)
    cpu_native.check(cpu_native.library().ps_gemm_intn(
        w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), w.scales_and_zeros.shape[-1], w.bits, w.out_features,
        w.in_features, w.group_size, x2.data_ptr(), x2.shape[0], y.data_ptr(),
        cpu_native.threads_for(w.out_features * w.in_features, GEMV_MIN_WEIGHTS_PER_THREAD)), "5/6-bit GEMM")
    return y


def intn_linear(x: torch.Tensor, w: IntNWeight, bias: torch.Tensor | None = None,
                dense_min_rows: int = INTN_DENSE_MIN_ROWS) -> torch.Tensor:
    """x [..., in] -> [..., out]; packs exist only where intn_built() (the loader checks)."""
    shape, dtype = x.shape, x.dtype
    x2 = x.reshape(-1, shape[-1])
    if dense_path(x2, dense_min_rows):
        y = torch.mm(x2.to(torch.bfloat16), intn_to_bf16_t(w))
    else:
        y = _intn_gemm(x2, w)
    y = y.to(dtype).reshape(*shape[:-1], w.out_features)
    return y if bias is None else y + bias
