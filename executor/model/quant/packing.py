"""From the pieces a layer was loaded in to the one form its kernel reads (the layer then picks the linear
method that runs that form: layers/linear_method.py).

A merged layer (q/k/v, gate/up) arrives in pieces, and in a GGUF file they need not share a format: a Q4_K_M
file stores v in Q6_K beside q and k in Q4_K. So a layer collects (first row, piece) pairs while loading and
picks its kernel once all are in:
- every piece 4-bit, in one group size the int4 kernel takes: int4, exact (the scales round to bfloat16);
- 5- and 6-bit pieces (GGUF Q5_0 ... Q6_K, with 4-bit pieces beside them) on CPUs that build its kernel:
  their own width (kernels/weights/weight_intn.py), exact up to the scales' bfloat16, where that is fewer bytes
  than int8;
- pieces no one of those forms holds at their size (a Q5_0 q and k beside a Q8_0 v; a Q4_K q and k beside a
  Q6_K v) on CPU: each run of like pieces in its own form, side by side (kernels/weights/weight_split.py);
- any other quantized piece (8 bits, or the above elsewhere): int8 per output channel, requantized from the
  decoded values (|error| <= half a step of max|w| / 127 per row, on top of the format's own);
- dense pieces: int8 or fp8 when the method asks for it, else a plain tensor in the model's dtype.
GPTQ act-order pieces hold their columns sorted by group (see group_quant.py): int4 keeps that order and
wraps the kernel form in PermutedInput, which gathers x's columns to match. Pieces of one merged layer share
one input, and GPTQ derives the order from that input's statistics, so their orders agree in real
checkpoints; where they do not, the pieces take the int8 route in checkpoint order, which any order allows.
"""
from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Union

import torch

from pagedserve.executor.model.quant.group_quant import GroupQuantWeight
from pagedserve.kernels.weights.weight_intn import IntNWeight, intn_built, intn_fits, intn_nbytes, pack_intn
from pagedserve.kernels.weights.weight_only import (INT4_GROUP_SIZES, Int4Weight, Int8Weight, pack_int4,
                                            quantize_int8)
from pagedserve.kernels.weights.weight_split import RowSplitWeight

Piece = tuple[int, Union[torch.Tensor, GroupQuantWeight]]     # (first output row, rows)
# The kernel forms a layer's weight may take (fp8's Fp8Weight too); layers/linear_method.py runs each.
Packed = Union[Int4Weight, IntNWeight, Int8Weight, RowSplitWeight, torch.Tensor, "PermutedInput"]


@dataclass
class PermutedInput:
    """A kernel form whose input columns are in act-order: y = inner(x[..., perm]); with zero_input, perm
    entries equal to x's width read a zero (a tensor-parallel slice's padding). Run by
    layers/linear_method.py:ActOrderInt4LinearMethod."""
    inner: Int4Weight
    perm: torch.Tensor       # int64 [kernel in]
    zero_input: bool = False

    @property
    def nbytes(self) -> int:
        return self.inner.nbytes + self.perm.numel() * self.perm.element_size()


def _check_rows(pieces: Sequence[Piece], rows: int, what: str) -> None:
    covered = sorted((start, start + piece.shape[0]) for start, piece in pieces)
    end = 0
    for start, stop in covered:
        if start != end:
            raise ValueError(f"{what}: rows {end}..{start} were not loaded (or loaded twice)")
        end = stop
    if end > rows:
        raise ValueError(f"{what}: {end} rows loaded into a weight of {rows}")


def check_all_rows(pieces: Sequence[Piece], rows: int, what: str) -> None:
    """An update's pieces of a packed weight must fill every row: the weight is packed again from them alone
    (its old values exist only in the packed form, which cannot be unpacked for every format)."""
    _check_rows(pieces, rows, what)
    end = max((start + piece.shape[0] for start, piece in pieces), default=0)
    if end != rows:
        raise ValueError(f"{what}: this update fills rows 0..{end} of {rows}; a quantized layer is packed again "
                         "from all of its checkpoint tensors, so an update must carry them together (q, k and v; "
                         "gate and up; every part of a quantized checkpoint's linear)")


def _ordered(pieces: Sequence[Piece]) -> list:
    return [piece for _, piece in sorted(pieces, key=lambda p: p[0])]


def _dense(parts: list, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """The pieces as one float tensor [rows, in]; rows past the last piece (vocabulary padding) are zero."""
    mats = [p.dequantize(torch.float32) if isinstance(p, GroupQuantWeight) else p.float() for p in parts]
    w = torch.cat(mats, 0) if len(mats) > 1 else mats[0]
    if w.shape[0] < rows:
        w = torch.cat((w, w.new_zeros(rows - w.shape[0], w.shape[1])), 0)
    return w.to(dtype)


def _pad_rows(t: torch.Tensor, rows: int, value: int | float = 0) -> torch.Tensor:
    """t [r, c] with rows r..rows-1 (vocabulary padding past the last piece) filled with value."""
    pad = rows - t.shape[0]
    return torch.cat((t, t.new_full((pad, t.shape[1]), value)), 0) if pad > 0 else t


def _stack_pieces(parts: Sequence[GroupQuantWeight], rows: int, pad_code: int, scales: Sequence[torch.Tensor],
                  zeros: Sequence[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pieces' codes and (scale, zero) per group stacked in row order; rows past the last piece (vocabulary
    padding) read code pad_code with scale and zero 0: zero rows."""
    q = _pad_rows(torch.cat([p.q for p in parts], 0), rows, pad_code)
    return q, _pad_rows(torch.cat(list(scales), 0), rows), _pad_rows(torch.cat(list(zeros), 0), rows)


def _int4(parts: list[GroupQuantWeight], rows: int, device: torch.device) -> Int4Weight | PermutedInput:
    # Our form is w = scale * q + offset; the kernel's is (q - 8) * scale + zero.
    q, scale, zero = _stack_pieces(parts, rows, 8, [p.scale for p in parts],
                                   [p.offset + 8 * p.scale for p in parts])
    offset = None
    if all(p.k_quant for p in parts):       # exact offsets too (zero - 8 * scale may round): two-level scales
        offset = _pad_rows(torch.cat([p.offset for p in parts], 0), rows)
    packed = pack_int4(q, scale, zero, parts[0].group_size, device, offset)
    perm = parts[0].perm
    return packed if perm is None else PermutedInput(packed, perm.to(device), parts[0].inputs is not None)


def int4_fits(parts: Sequence, device: torch.device) -> bool:
    if not parts or not all(isinstance(p, GroupQuantWeight) and p.bits <= 4 for p in parts):
        return False
    group = parts[0].group_size
    if any(p.group_size != group for p in parts) or group not in INT4_GROUP_SIZES:
        return False
    perm = parts[0].perm
    if any((p.perm is None) != (perm is None) or (perm is not None and not torch.equal(p.perm, perm))
           for p in parts):
        return False          # act-order pieces in different column orders: one gather cannot serve all
    return device.type == "cpu" or parts[0].shape[1] % 128 == 0


def _intn(parts: Sequence, rows: int, device: torch.device) -> IntNWeight | None:
    """5/6-bit pieces (4-bit ones beside them widened to the same codes) in the 5/6-bit pack, in the finest
    group size among them; None where that form does not apply or is not smaller than int8's."""
    if (device.type != "cpu" or not parts or not intn_built()
            or not all(isinstance(p, GroupQuantWeight) and p.perm is None for p in parts)):
        return None
    bits, group = max(p.bits for p in parts), min(p.group_size for p in parts)
    cols = parts[0].shape[1]
    if not intn_fits(rows, cols, bits, group) or any(p.group_size % group for p in parts):
        return None
    mid = 1 << (bits - 1)
    # w = scale * q + offset = (q - mid) * scale + (offset + mid * scale), each piece's groups repeated to `group`
    q, scale, zero = _stack_pieces(parts, rows, 0,
                                   [p.scale.repeat_interleave(p.group_size // group, 1) for p in parts],
                                   [(p.offset + mid * p.scale).repeat_interleave(p.group_size // group, 1)
                                    for p in parts])
    if intn_nbytes(rows, cols, bits, group, bool(zero.any())) >= rows * cols:     # int8: ~1 byte a weight
        return None
    return pack_intn(q, scale, zero, bits, group)


def _narrow(parts: list, rows: int, device: torch.device) -> Int4Weight | PermutedInput | IntNWeight | None:
    """The pieces in a form at about their own width (int4, or the 5/6-bit pack), or None."""
    if int4_fits(parts, device):
        return _int4(parts, rows, device)
    return _intn(parts, rows, device)


def _runs(parts: list) -> list[list]:
    """Neighbouring pieces that one narrow form holds at their width: same bits and group (and no act-order)."""
    def key(p: Any) -> tuple:
        return (p.bits, p.group_size) if isinstance(p, GroupQuantWeight) and p.perm is None else (id(p),)
    runs: list[list] = []
    for p in parts:
        if runs and key(runs[-1][-1]) == key(p):
            runs[-1].append(p)
        else:
            runs.append([p])
    return runs


def _row_split(parts: list, rows: int, device: torch.device) -> RowSplitWeight | None:
    """Pieces no one narrow form takes at their size (Q5_0 q, k beside a Q8_0 v), each run of like pieces in
    its own form, where any run is narrow (kernels/weights/weight_split.py); None otherwise."""
    runs = _runs(parts)
    if device.type != "cpu" or len(runs) < 2 or sum(p.shape[0] for p in parts) != rows:
        return None
    forms: list = []
    for run in runs:
        width = sum(p.shape[0] for p in run)
        form = _narrow(run, width, device) if width % 64 == 0 else None
        if isinstance(form, PermutedInput):
            return None
        forms.append(form if form is not None else _int8(run, width))
    if not any(isinstance(f, (Int4Weight, IntNWeight)) for f in forms):
        return None
    return RowSplitWeight(tuple(forms), tuple(f.out_features for f in forms))


def _int8(parts: list, rows: int) -> Int8Weight:
    return quantize_int8(_dense(parts, rows, torch.float32))       # one scale per row: one kernel call


def pack_linear(pieces: Sequence[Piece], rows: int, method: str, device: torch.device,
                dtype: torch.dtype, what: str) -> Packed:
    """The kernel form of one linear weight [rows, in] from its loaded pieces."""
    _check_rows(pieces, rows, what)
    parts = _ordered(pieces)
    quantized = any(isinstance(p, GroupQuantWeight) for p in parts)
    narrow = (_narrow(parts, rows, device) or _row_split(parts, rows, device)) if quantized else None
    if narrow is not None:
        return narrow
    if quantized or method == "int8":
        w = _int8(parts, rows)
        return Int8Weight(w.q.to(device), w.scale.to(device))
    if method == "fp8":
        from pagedserve.executor.model.quant.fp8 import pack_fp8
        return pack_fp8(_dense(parts, rows, torch.float32).to(device))
    return _dense(parts, rows, dtype).to(device)


def _symmetric_int8(parts: list, rows: int) -> Int8Weight | None:
    """8-bit symmetric groups (Q8_0) as they are: the codes, minus 128, with each group's own scale."""
    if not all(isinstance(p, GroupQuantWeight) and p.bits == 8 and p.perm is None
               and torch.equal(p.offset, -128 * p.scale) for p in parts) or len({p.group_size for p in parts}) != 1:
        return None
    g = parts[0].group_size
    q = torch.cat([p.q for p in parts], 0).view(torch.int8) ^ -128        # q - 128, wrapping as int8
    scale = torch.cat([p.scale for p in parts], 0)
    if q.shape[0] < rows:
        q = torch.cat((q, q.new_zeros(rows - q.shape[0], q.shape[1])), 0)
        scale = torch.cat((scale, scale.new_zeros(rows - scale.shape[0], scale.shape[1])), 0)
    chunks = q.shape[1] // g
    return Int8Weight(q.view(rows, chunks, g).transpose(0, 1).contiguous(),
                      scale.t().contiguous().to(torch.bfloat16))


def pack_embedding(pieces: Sequence[Piece], rows: int, method: str, device: torch.device, dtype: torch.dtype,
                   what: str) -> Int4Weight | Int8Weight | torch.Tensor:
    """An embedding table: quantized sources become int8 or, 4-bit ones on CPU, int4 (a lookup widens only
    the rows it reads).

    The table usually serves a tied LM head too, whose logits decide every greedy token, so it keeps the
    format's own group scales: 4-bit sources (Q4_0, Q4_1, Q4_K) exactly as int4, in the pack the head's GEMV
    streams (half an int8 table's bytes a token: at the 360M ladder model 26 of 47 MB), Q8_0 exactly as int8,
    others requantized to int8 per group (255 levels, finer than any 5-6 bit source). One scale per row, as
    plain int8 has, moved greedy tokens on 4 of 8 chat prompts of the embedded model; group scales moved none.
    """
    _check_rows(pieces, rows, what)
    parts = _ordered(pieces)
    if device.type == "cpu" and rows % 64 == 0 and int4_fits(parts, device) and parts[0].perm is None:
        return _int4(parts, rows, device)
    groups = [p.group_size for p in parts if isinstance(p, GroupQuantWeight)]
    if not groups and method != "int8":
        return _dense(parts, rows, dtype).to(device)
    exact = _symmetric_int8(parts, rows)
    if exact is None:
        exact = quantize_int8(_dense(parts, rows, torch.float32), chunk=min(groups, default=32))
    return Int8Weight(exact.q.to(device), exact.scale.to(device))


def _same_form(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape
                and a.dtype == b.dtype and a.device == b.device)
    if isinstance(a, tuple) and isinstance(b, tuple):       # RowSplitWeight's parts
        return len(a) == len(b) and all(_same_form(x, y) for x, y in zip(a, b))
    if dataclasses.is_dataclass(a):
        return type(a) is type(b) and all(_same_form(getattr(a, f.name), getattr(b, f.name))
                                          for f in dataclasses.fields(a))
    return a == b


def _copy_form(dst: Any, src: Any) -> None:
    if isinstance(dst, torch.Tensor):
        dst.data.copy_(src)
    elif isinstance(dst, tuple):
        for d, s in zip(dst, src):
            _copy_form(d, s)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            _copy_form(getattr(dst, f.name), getattr(src, f.name))


def copy_into_form(dst: Packed | torch.Tensor, src: Packed | torch.Tensor) -> bool:
    """Copy a newly packed weight into the current one when both are the same kernel form with the same
    shapes and dtypes (returns True): the current tensors keep their storage, so what holds their addresses
    (CUDA graphs, the C decode step) reads the new values. False, and nothing copied, otherwise."""
    if not _same_form(dst, src):
        return False
    _copy_form(dst, src)
    return True


def packed_nbytes(packed: Packed) -> int:
    if isinstance(packed, torch.Tensor):
        return packed.numel() * packed.element_size()
    return packed.nbytes
