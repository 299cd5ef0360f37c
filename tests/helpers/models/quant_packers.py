"""Pack a float weight into real AWQ (AutoAWQ GEMM) and GPTQ checkpoint tensors, written from the layout
definitions with plain per-word loops, so the tests check our vectorized unpackers against an independent
packer rather than against themselves.

Quantization is round-to-nearest per group of input columns, asymmetric with a zero point (as AutoAWQ and
GPTQ's asymmetric mode) or GPTQ's symmetric mode (zero fixed at the middle code). Scales are rounded to
fp16 first, as checkpoints store them, and the codes are computed against the stored scales.

GPTQ act-order (desc_act) is written as GPTQ writes it: the columns are visited in an order (GPTQ's comes
from the Hessian diagonal, here a seeded random permutation), consecutive runs of group_size visited
columns form the groups, g_idx[column] names its group, and qweight keeps the checkpoint's column order.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

_AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)      # AutoAWQ: nibble k of a word holds column _AWQ_ORDER[k]


@dataclass
class Quantized:
    codes: torch.Tensor     # int64 [out, in]
    scale: torch.Tensor     # float32 [out, groups] (fp16-representable)
    zero: torch.Tensor      # int64 [out, groups]
    group_size: int
    g_idx: torch.Tensor | None = None    # int64 [in]: each column's group; None: column // group_size

    def groups_of_columns(self) -> torch.Tensor:
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.codes.shape[1]) // self.group_size

    def dequantize(self) -> torch.Tensor:
        idx = self.groups_of_columns()
        return (self.codes - self.zero[:, idx]).float() * self.scale[:, idx]


def quantize_rtn(w: torch.Tensor, bits: int, group_size: int, sym: bool = False) -> Quantized:
    """Round-to-nearest per (row, group of group_size columns); group_size -1: one group per row."""
    out, cols = w.shape
    g = cols if group_size == -1 else group_size
    maxq = (1 << bits) - 1
    groups = w.float().reshape(out, cols // g, g)
    if sym:
        scale = (groups.abs().amax(-1) * 2 / maxq).clamp(min=1e-5).half().float()
        zero = torch.full_like(scale, (maxq + 1) // 2, dtype=torch.int64)
    else:
        lo, hi = groups.amin(-1), groups.amax(-1)
        scale = ((hi - lo).clamp(min=1e-5) / maxq).half().float()
        zero = (-torch.round(lo / scale)).clamp(0, maxq).to(torch.int64)
    codes = (torch.round(groups / scale.unsqueeze(-1)) + zero.unsqueeze(-1)).clamp(0, maxq).to(torch.int64)
    return Quantized(codes.reshape(out, cols), scale, zero, g)


def _to_int32(words: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(words.astype(np.uint32).view(np.int32).copy())


def _pack_along_cols(values: np.ndarray, bits: int, order: tuple[int, ...]) -> np.ndarray:
    """values [r, c] -> uint64 words [r, c / per_word]; code order[k] of each run goes in slot k."""
    per_word = 32 // bits
    rows, cols = values.shape
    words = np.zeros((rows, cols // per_word), dtype=np.uint64)
    for word in range(cols // per_word):
        for k in range(per_word):
            words[:, word] |= values[:, word * per_word + order[k]].astype(np.uint64) << np.uint64(bits * k)
    return words


def pack_awq(w: torch.Tensor, group_size: int) -> tuple[dict[str, torch.Tensor], Quantized]:
    """AutoAWQ GEMM tensors (qweight [in, out/8], qzeros [in/g, out/8], scales fp16 [in/g, out]) for w [out, in]."""
    quant = quantize_rtn(w, 4, group_size)
    qweight = _pack_along_cols(quant.codes.t().numpy(), 4, _AWQ_ORDER)
    qzeros = _pack_along_cols(quant.zero.t().numpy(), 4, _AWQ_ORDER)
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros),
            "scales": quant.scale.t().contiguous().half()}, quant


def _act_order_quantize(w: torch.Tensor, bits: int, group_size: int, sym: bool, seed: int) -> Quantized:
    """Quantize the columns in a random visiting order, groups being runs of that order; codes returned in
    the checkpoint's column order with g_idx."""
    order = torch.randperm(w.shape[1], generator=torch.Generator().manual_seed(seed))
    visited = quantize_rtn(w[:, order], bits, group_size, sym)
    codes = torch.empty_like(visited.codes)
    codes[:, order] = visited.codes
    g_idx = torch.empty(w.shape[1], dtype=torch.int64)
    g_idx[order] = torch.arange(w.shape[1]) // visited.group_size
    return Quantized(codes, visited.scale, visited.zero, visited.group_size, g_idx)


def pack_gptq(w: torch.Tensor, bits: int, group_size: int, sym: bool = False, checkpoint_format: str = "gptq",
              act_order_seed: int | None = None) -> tuple[dict[str, torch.Tensor], Quantized]:
    """GPTQ tensors (qweight [in/p, out], qzeros [groups, out/p], scales fp16 [groups, out], g_idx [in]),
    p = 32 / bits, for w [out, in]; format "gptq" stores zero - 1, "gptq_v2" the zero. With an
    act_order_seed: act-order (desc_act), the visiting order a permutation drawn from that seed."""
    if act_order_seed is None:
        quant = quantize_rtn(w, bits, group_size, sym)
    else:
        quant = _act_order_quantize(w, bits, group_size, sym, act_order_seed)
    per_word = 32 // bits
    codes = quant.codes.t().numpy()                        # [in, out]: packed down the rows
    qweight = np.zeros((codes.shape[0] // per_word, codes.shape[1]), dtype=np.uint64)
    for row in range(qweight.shape[0]):
        for k in range(per_word):
            qweight[row] |= codes[row * per_word + k].astype(np.uint64) << np.uint64(bits * k)
    zeros = quant.zero.t().numpy()                         # [groups, out]
    if checkpoint_format == "gptq":
        if (zeros == 0).any():
            # v1's zero - 1 underflows here (the bug gptq_v2 fixed); tests pick weights that avoid it.
            raise ValueError("gptq v1 cannot store a zero point of 0")
        zeros = zeros - 1
    qzeros = _pack_along_cols(zeros, bits, tuple(range(per_word)))
    g_idx = quant.groups_of_columns().to(torch.int32)
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros),
            "scales": quant.scale.t().contiguous().half(), "g_idx": g_idx}, quant
