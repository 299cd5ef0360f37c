"""Weight-only int4 / int8 GEMMs: the weights stay packed in memory and are widened inside the kernel.

int4 is group-affine (w = (q - 8) * scale + zero per group of input columns, torch's tinygemm convention),
int8 is symmetric with one scale per output channel and chunk of input columns (w = q * scale); the kernel
takes one scale per channel, so each chunk is its own call (a whole row is one chunk for plain int8). Both run on torch's own kernels: on CPU
`_weight_int4pack_mm_for_cpu` / `_weight_int8pack_mm` (AVX512/AVX2), on CUDA `_weight_int4pack_mm` (tinygemm).
Those kernels only run fast with bfloat16 activations (measured here at batch 1: 15 µs in bfloat16 against
332 µs in float32 for a 576x576 int4 GEMM), so other activations are cast to bfloat16 around the call.

On CPUs with AVX512-VNNI an int4 call of 4 to int4_dense_min_rows() - 1 rows runs our integer GEMM instead
(kernels/cpu/csrc/gemm_int4.c: float32 in and out, inputs rounded to int16), which beat every other path there.
With AVX512-VBMI too it takes 1-3 rows as well (its GEMV form), elsewhere fewer rows keep the float GEMV (the
library says from how many: ps_gemm_int4_min_rows). From INT4_INT8_MIN_ROWS rows (prefill chunks, big decode
batches) a VBMI build rounds the inputs to int8 per row and group instead and multiplies bytes
(kernels/cpu/csrc/gemm_int4_s8.c): 1.5x the int16 form's rate, and there no int4 call widens for oneDNN. On
CPUs with AMX its tiles take those calls (kernels/cpu/csrc/gemm_int4_amx.c, the same bits; PAGEDSERVE_CPU_AMX=0
keeps the VNNI tile), except that with AMX-BF16 weights of up to INT4_AMX_DENSE_MAX_WEIGHTS widen for oneDNN,
whose bfloat16 tiles beat our int8 tile there.

torch's kernels are GEMV kernels at heart: their cost grows with the input rows at a fraction of a dense GEMM's
speed.
On a CPU with native bfloat16, from DENSE_MIN_ROWS rows on, the weight is widened once per call by
kernels/cpu/csrc/dequant.c into a transient bfloat16 matrix and multiplied by oneDNN instead: per shape, batch-1
decode keeps the packed kernels and prefill chunks and large decode batches take the dense path
(docs/cpu_performance.md has the crossovers).
"""
from __future__ import annotations

import functools
import sys
from dataclasses import dataclass
from typing import NamedTuple

import torch

from pagedserve.common import envs
from pagedserve.common.config.dtype import cpu_has_amx_bf16, cpu_has_native_bf16
from pagedserve.kernels.cpu import dequant as cpu_dequant
from pagedserve.kernels.cpu import int4_pack
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.weights.weight_kquant import k_form_scale_offset, k_form_scales

INT4_GROUP_SIZES = (32, 64, 128, 256)
_INNER_K_TILES = 8          # CUDA tinygemm packing; K must be a multiple of 16 * this
# Input rows from which the widen-then-dense path wins on CPU (docs/cpu_performance.md): against torch's
# int4 kernel int4 breaks even near 48 rows; torch's int8 kernel re-reads the weight for every row, so int8
# pays from 16. Against the integer int4 GEMM (kernels/cpu/csrc/gemm_int4.c, AVX512-VNNI) int4 breaks even
# between 192 and 256 rows (docs/cpu_performance.md, the embedded model's 30 layers streamed from memory).
INT4_DENSE_MIN_ROWS = 64
INT4_DENSE_MIN_ROWS_AFTER_GEMM = 224
# Rows from which an int4 call rounds its inputs to int8 (gemm_int4_s8.c). Coarser than int16 (half a step is
# max|x| / 254 of a group, as llama.cpp's Q8_0 activations; bfloat16's is 2**-9 of each value), so below
# it, where decode steps run, the int16 form keeps the embedded model's greedy tokens on the dequantized
# model's (issue 14's bar: int8 inputs at every row count kept 5 of 8 chat prompts). From here the rows
# widened to bfloat16 before (224), and the int8 form beats widening at every count measured (the 1.7B
# layers: 1.5x at 512 rows, 1.3x at 2048, docs/cpu_performance.md), so no int4 call widens where it runs.
INT4_INT8_MIN_ROWS = 224
INT4_NEVER_DENSE = sys.maxsize
# Weights (out x in) up to which a many-row int4 call widens for oneDNN on a CPU with AMX-BF16 (oneDNN multiplies
# bfloat16 on AMX tiles). Widening's time over the int8-input GEMM's (its AMX tile), 512 rows: 0.69-0.86x on the
# 135M and 360M layers (5120 x 960 included), 0.70x at 4096 x 2048, 0.86x at 6144 x 2048 (0.70x at 2048 rows),
# but 1.05x at 2048 x 8192 and 1.43x at 8192 x 2048, the 1.7B model's 16.8M-weight MLP layers
# (docs/cpu_performance.md, 2026-11-28 afternoon).
INT4_AMX_DENSE_MAX_WEIGHTS = 6144 * 2048
# Rows from which an int8 call widens for oneDNN. Below, where the C GEMVs are built, the int8 GEMV takes any
# row count (gemv_int8.c: four rows at a time over each block's codes): 9-15 rows went through torch's int8 kernel
# before, one call per chunk of columns (the 1.7B model's Q6_K head at 12 rows: 440 ms, the GEMV's ~26).
# Crossovers with widening measured on one thread: 24 rows for 16-column chunks (Q6_K), 14 for 32 (Q8_0),
# 16 for whole rows.
INT8_DENSE_MIN_ROWS = 16
# Output rows of an int8 weight widened at a time: 4096 x 576 bfloat16 is 4.7 MB, transient, so a tied
# 49152-row head never exists in bfloat16 (the 56 MB it would take is more than the quantized model).
INT8_DENSE_BLOCK_ROWS = 4096
GEMV_MAX_ROWS = 8                          # kernels/cpu/csrc/gemv.h
# Below this many weights a C GEMV runs on the caller's thread alone. On torch's OpenMP threads a second
# thread pays even for small layers (measured: a 576x576 int4 GEMV 19.2 us on one thread, 13.0 on two).
GEMV_MIN_WEIGHTS_PER_THREAD = 1 << 16


@dataclass
class Int4Weight:
    packed: torch.Tensor             # the kernel's own packed layout
    # bfloat16 [in // group_size, out, 2]: (scale, zero); [.., 1] on CPU for symmetric groups (zeros all 0, as
    # GGUF Q4_0 has): a tenth of the bytes a token reads, which our C kernels skip (see pack_int4); or on CPU
    # a K-quant's two-level scales, int16 (kernels/weights/weight_kquant.py)
    scales_and_zeros: torch.Tensor
    group_size: int
    out_features: int
    in_features: int

    @property
    def sz_form(self) -> int:
        """The scales' form as the C kernels name it (cpu_native.SZ_*)."""
        return cpu_native.int4_sz_form(self.scales_and_zeros)

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed) + _nbytes(self.scales_and_zeros)


@dataclass
class Int8Weight:
    q: torch.Tensor          # int8 [chunks, out, chunk]: each chunk's codes contiguous, as the kernel reads them
    scale: torch.Tensor      # bfloat16 [chunks, out]

    @property
    def out_features(self) -> int:
        return self.q.shape[1]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.q) + _nbytes(self.scale)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def pack_int4(q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group_size: int,
              device: torch.device | str, offset: torch.Tensor | None = None) -> Int4Weight:
    """q uint8 [out, in] codes 0..15, scale/zero float [out, in // group_size] (w = (q - 8) * scale + zero).
    offset: w = scale * q + offset too, given where the scales may be a K-quant's, which our CPU kernels then
    keep in the K form (kernels/weights/weight_kquant.py) if they factor exactly."""
    out, cols = q.shape
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 kernels take group sizes {INT4_GROUP_SIZES}, not {group_size}")
    sz = torch.stack((scale, zero), dim=-1).transpose(0, 1).contiguous().to(torch.bfloat16)
    if torch.device(device).type == "cuda":
        if cols % (16 * _INNER_K_TILES):
            raise ValueError(f"int4 on CUDA needs input features divisible by {16 * _INNER_K_TILES}, got {cols}")
        q = q.to(device)
        nibbles = ((q[:, ::2] << 4) | q[:, 1::2]).to(torch.uint8)
        packed = torch._convert_weight_to_int4pack(nibbles.contiguous(), _INNER_K_TILES)
        return Int4Weight(packed, sz.to(device), group_size, out, cols)
    packed = torch._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 2)
    if _native().int4_gemv and _native().int4_gemm:
        if not bool(sz[..., 1].any()):                  # symmetric: scales alone, 4.5 bits a weight
            return Int4Weight(packed, sz[..., :1].contiguous(), group_size, out, cols)
        k_form = None if offset is None else k_form_scales(scale, offset)     # 4.625 bits, else pairs' 5
        if k_form is not None:
            return Int4Weight(packed, k_form, group_size, out, cols)
    return Int4Weight(packed, sz, group_size, out, cols)


def scale_offset(w: Int4Weight) -> tuple[torch.Tensor, torch.Tensor]:
    """Each group's (scale, offset) per output channel, float32 [groups, out]: w = scale * code + offset."""
    if w.sz_form == cpu_native.SZ_K:
        return k_form_scale_offset(w.scales_and_zeros, w.in_features // w.group_size)
    sz = w.scales_and_zeros.float()
    scale = sz[..., 0]
    return scale, (sz[..., 1] if sz.shape[-1] == 2 else 0.0) - 8 * scale


def scale_zero_pairs(w: Int4Weight) -> torch.Tensor:
    """The bfloat16 (scale, zero) pairs [groups, out, 2] torch's own int4 kernel reads. Symmetric and K-form
    packs store other forms, and reach torch's kernel only on calls our C kernels do not take (no native
    bfloat16 for the dense path)."""
    sz = w.scales_and_zeros
    if w.sz_form == cpu_native.SZ_K:
        scale, offset = scale_offset(w)
        return torch.stack((scale, offset + 8 * scale), -1).to(torch.bfloat16)
    return sz if sz.shape[-1] == 2 else torch.cat((sz, torch.zeros_like(sz)), -1)


def dense_path(x2: torch.Tensor, min_rows: int) -> bool:
    """Whether this CPU call widens the weight and runs a dense bfloat16 GEMM (see the module's docstring)."""
    return (x2.shape[0] >= min_rows and x2.device.type == "cpu" and cpu_has_native_bf16()
            and cpu_native.library() is not None)


class _Native(NamedTuple):
    gemv: bool              # the vector int8 GEMV of kernels/cpu/csrc/gemv_int8.c (AVX-512 or AVX2)
    int4_gemm: bool         # the AVX512-VNNI int4 GEMM of kernels/cpu/csrc/gemm_int4.c
    int4_gemm_min_rows: int  # rows from which it beats the GEMV (gemm_int4.h says why)
    int4_gemm_int8: bool    # its int8-input form (gemm_int4_s8.c), for INT4_INT8_MIN_ROWS rows and more
    # that form's entry point: ps_gemm_int4_s8 takes AMX tiles where the CPU has them (gemm_int4_amx.c, the same
    # bits as the VNNI tile), ps_gemm_int4_s8_vnni never does (PAGEDSERVE_CPU_AMX=0, read once)
    int4_gemm_int8_kernel: str = "ps_gemm_int4_s8"
    int4_gemv: bool = False  # a vector int4 GEMV for the pack form torch writes here (AVX-512 or AVX2)


@functools.lru_cache(maxsize=1)
def _native() -> _Native:
    """What this machine's build of the C kernels has: asked once, not on every linear."""
    lib = cpu_native.library()
    if lib is None:
        return _Native(False, False, 0, False)
    # The int4 GEMMs read torch's AVX-512 pack alone, the GEMV the AVX-512 or AVX2 one as built
    # (kernels/cpu/int4_pack.py): where torch writes another, its own kernel keeps those int4 calls.
    layout = int4_pack.pack_layout()
    vector_pack = layout == int4_pack.PACK_AVX512
    return _Native(bool(lib.ps_gemv_int8_vectorized()), vector_pack and bool(lib.ps_gemm_int4_vectorized()),
                   int(lib.ps_gemm_int4_min_rows()), vector_pack and bool(lib.ps_gemm_int4_s8_built()),
                   "ps_gemm_int4_s8" if envs.PAGEDSERVE_CPU_AMX else "ps_gemm_int4_s8_vnni",
                   bool(lib.ps_gemv_int4_layouts() >> layout & 1))


def int4_dense_min_rows(w: Int4Weight | None = None) -> int:
    """Input rows from which an int4 linear on CPU widens its weight for a dense GEMM (INT4_NEVER_DENSE:
    never, where the int8-input GEMM takes the many-row calls; with AMX-BF16 weights of up to
    INT4_AMX_DENSE_MAX_WEIGHTS widen from INT4_INT8_MIN_ROWS rows, w given)."""
    native = _native()
    if native.int4_gemm and native.int4_gemm_int8:
        if (w is not None and w.out_features * w.in_features <= INT4_AMX_DENSE_MAX_WEIGHTS
                and cpu_has_amx_bf16()):
            return INT4_INT8_MIN_ROWS
        return INT4_NEVER_DENSE
    return INT4_DENSE_MIN_ROWS_AFTER_GEMM if native.int4_gemm else INT4_DENSE_MIN_ROWS


def _gemv_path(x2: torch.Tensor, int4: bool = False) -> bool:
    """A CPU call that a vector GEMV of kernels/cpu/csrc/gemv_entry.c takes (float32, weight read once for
    GEMV_MAX_ROWS rows; torch's int8 kernel reads it once per row and wants bfloat16 activations). Where the
    integer int4 GEMM is not built (AVX2, AVX-512 without VNNI) the int4 GEMV takes every row count, 8 rows a
    pass: torch's kernel from 9 rows rounded the inputs to bfloat16, so a prompt's row got other bits in a
    chunk of 9+ rows than after a prefix-cache hit of a few (docs/determinism.md), at about the GEMV's speed."""
    native = _native()
    if x2.device.type != "cpu":
        return False
    if int4:
        return native.int4_gemv and (x2.shape[0] <= GEMV_MAX_ROWS or not native.int4_gemm)
    return native.gemv and x2.shape[0] <= GEMV_MAX_ROWS


def _int4_native(x2: torch.Tensor, w: Int4Weight, kernel: str, *layout: int) -> torch.Tensor:
    """One of the C int4 kernels with the pack's signature: ps_gemm_int4 (integer GEMM) or ps_gemv_int4 (which
    is told the pack's form, layout)."""
    x2 = x2.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], w.out_features, dtype=torch.float32)
    cpu_native.check(getattr(cpu_native.library(), kernel)(
        w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), w.sz_form, *layout, w.out_features,
        w.in_features, w.group_size,
        x2.data_ptr(), x2.shape[0], y.data_ptr(),
        cpu_native.threads_for(w.packed.numel() * 2, GEMV_MIN_WEIGHTS_PER_THREAD)), kernel)
    return y


def _int4_gemm(x2: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    return _int4_native(x2, w, "ps_gemm_int4")


def _int4_gemm_s8(x2: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    return _int4_native(x2, w, _native().int4_gemm_int8_kernel)


def _int4_gemv(x2: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    return _int4_native(x2, w, "ps_gemv_int4", int4_pack.pack_layout())


def _int8_gemv(x2: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    chunks, rows, chunk = w.q.shape
    x2 = x2.to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], rows, dtype=torch.float32)
    cpu_native.check(cpu_native.library().ps_gemv_int8(
        w.q.data_ptr(), w.scale.data_ptr(), chunks, rows, chunk, x2.data_ptr(), x2.shape[0], y.data_ptr(),
        cpu_native.threads_for(w.q.numel(), GEMV_MIN_WEIGHTS_PER_THREAD)), "int8 GEMV")
    return y


def int4_linear(x: torch.Tensor, w: Int4Weight, bias: torch.Tensor | None = None,
                dense_min_rows: int | None = None) -> torch.Tensor:
    """dense_min_rows: input rows from which a CPU call widens the weight (None: int4_dense_min_rows())."""
    shape, dtype = x.shape, x.dtype
    dense_min_rows = int4_dense_min_rows(w) if dense_min_rows is None else dense_min_rows
    x2 = x.reshape(-1, shape[-1])
    y = None
    if w.out_features % 64 == 0 and x2.device.type == "cpu":
        native = _native()
        if native.int4_gemm_int8 and INT4_INT8_MIN_ROWS <= x2.shape[0] < dense_min_rows:
            y = _int4_gemm_s8(x2, w)
        elif native.int4_gemm and native.int4_gemm_min_rows <= x2.shape[0] < dense_min_rows:
            y = _int4_gemm(x2, w)
        elif _gemv_path(x2, int4=True):
            y = _int4_gemv(x2, w)
    if y is not None:
        y = y.to(dtype).reshape(*shape[:-1], w.out_features)
        return y if bias is None else y + bias
    x2 = x2.to(torch.bfloat16)
    if x2.is_cuda:
        y = torch._weight_int4pack_mm(x2.contiguous(), w.packed, w.group_size, w.scales_and_zeros)
    elif w.out_features % 64 == 0 and dense_path(x2, dense_min_rows):
        y = torch.mm(x2, cpu_dequant.int4_to_bf16_t(w.packed, w.scales_and_zeros, w.out_features,
                                                    w.in_features, w.group_size))
    else:
        y = torch._weight_int4pack_mm_for_cpu(x2.contiguous(), w.packed, w.group_size, scale_zero_pairs(w))
    y = y.to(dtype).reshape(*shape[:-1], w.out_features)
    return y if bias is None else y + bias


def quantize_int8(w: torch.Tensor, chunk: int | None = None) -> Int8Weight:
    """Symmetric int8 of a float weight [out, in], one scale per row and chunk of columns (default: the
    whole row): |error| <= scale / 2 per weight."""
    wf = w.float()
    out, cols = wf.shape
    chunk = cols if chunk is None or chunk >= cols or cols % chunk else chunk
    groups = wf.view(out, cols // chunk, chunk).transpose(0, 1)                   # [chunks, out, chunk]
    scale = groups.abs().amax(dim=2).clamp_min(1e-12) / 127.0
    q = torch.round(groups / scale.unsqueeze(-1)).clamp_(-127, 127).to(torch.int8).contiguous()
    return Int8Weight(q, scale.to(torch.bfloat16))


def _int8_dense(x2: torch.Tensor, w: Int8Weight) -> torch.Tensor:
    rows = w.out_features
    step = min(rows, INT8_DENSE_BLOCK_ROWS)
    scratch = torch.empty(step, x2.shape[1], dtype=torch.bfloat16)
    if step == rows:
        return torch.mm(x2, cpu_dequant.int8_rows_to_bf16(w.q, w.scale, 0, rows, scratch).t())
    y = torch.empty(x2.shape[0], rows, dtype=torch.bfloat16)
    for first in range(0, rows, step):
        last = min(first + step, rows)
        block = cpu_dequant.int8_rows_to_bf16(w.q, w.scale, first, last, scratch[:last - first])
        y[:, first:last] = torch.mm(x2, block.t())
    return y


def int8_linear(x: torch.Tensor, w: Int8Weight, bias: torch.Tensor | None = None,
                dense_min_rows: int = INT8_DENSE_MIN_ROWS) -> torch.Tensor:
    shape, dtype = x.shape, x.dtype
    chunks, _, chunk = w.q.shape
    x2 = x.reshape(-1, shape[-1])
    # Without native bfloat16 nothing widens, and torch's int8 kernel (bfloat16 inputs, the weight re-read for
    # every row) ran 0.5-0.6x the GEMV's speed on the head at 16-64 rows: the GEMV takes every row count there,
    # and a row's bits never depend on how many rows (sequences sampled) share the call (docs/determinism.md).
    gemv_rows = x2.shape[0] < dense_min_rows or not cpu_has_native_bf16()
    if (x2.device.type == "cpu" and gemv_rows and _native().gemv and w.q.is_contiguous()
            and w.scale.is_contiguous()):
        y = _int8_gemv(x2, w).to(dtype).reshape(*shape[:-1], w.out_features)
        return y if bias is None else y + bias
    x2 = x2.to(torch.bfloat16)
    if dense_path(x2, dense_min_rows):
        y = _int8_dense(x2.contiguous(), w)
    elif chunks == 1:
        y = torch._weight_int8pack_mm(x2.contiguous(), w.q[0], w.scale[0])
    else:
        y = torch._weight_int8pack_mm(x2[:, :chunk].contiguous(), w.q[0], w.scale[0]).float()
        for i in range(1, chunks):
            y += torch._weight_int8pack_mm(x2[:, i * chunk:(i + 1) * chunk].contiguous(), w.q[i], w.scale[i])
    y = y.to(dtype).reshape(*shape[:-1], w.out_features)
    return y if bias is None else y + bias


def int4_embedding(ids: torch.Tensor, w: Int4Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows of an int4 table (a 4-bit source kept in the pack its tied head streams), widened: the C gather
    (dequant.c), else the same in PyTorch; both read the pack in the form this process's torch writes
    (kernels/cpu/int4_pack.py)."""
    flat = ids.reshape(-1).to(torch.int64).contiguous()
    k = w.in_features
    lib = cpu_native.library()
    if lib is not None:
        rows = torch.empty(flat.numel(), k, dtype=torch.float32)
        cpu_native.check(lib.ps_int4_rows(w.packed.data_ptr(), w.scales_and_zeros.data_ptr(),
                                          w.sz_form, int4_pack.pack_layout(), w.out_features, k, w.group_size,
                                          flat.data_ptr(), flat.numel(), rows.data_ptr()), "int4 embedding")
        return rows.to(dtype).reshape(*ids.shape, k)
    q = int4_pack.channel_codes(w.packed, k, flat, int4_pack.pack_layout()).float()
    scale, offset = (t.index_select(1, flat).t().repeat_interleave(w.group_size, 1) for t in scale_offset(w))
    rows = q * scale + offset                                                        # [T, k]
    return rows.to(dtype).reshape(*ids.shape, k)


def int8_embedding(ids: torch.Tensor, w: Int8Weight, dtype: torch.dtype) -> torch.Tensor:
    """Rows of an int8 table, widened: the table serves a tied LM head too, so it is kept once."""
    # index_select, not w.q[:, ids]: advanced indexing on the middle dimension took 4-20x its time (a 512-token
    # prompt's rows of the 135M model's table: 18 ms of a 350 ms prefill, cold)
    flat = ids.reshape(-1)
    rows = w.q.index_select(1, flat).to(dtype) * w.scale.index_select(1, flat).to(dtype).unsqueeze(-1)
    return rows.movedim(0, -2).reshape(*ids.shape, -1)
