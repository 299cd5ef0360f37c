"""The one in-memory form every quantized checkpoint format is decoded to before it is repacked for a kernel.

    w[o, i] = scale[o, i // group_size] * q[o, i] + offset[o, i // group_size]

with unsigned integer codes q in [0, 2**bits). GGUF blocks (Q4_0 ... Q6_K), AWQ and GPTQ all fit it, so the
sharding (tensor parallelism slices rows or whole groups of columns) and the repacking into the int4/int8
kernels' layouts are written once, against this form, whatever the checkpoint was.

GPTQ act-order (desc_act) checkpoints put input column i in group g_idx[i], so a group is not a run of
adjacent columns. They are held with their columns sorted by group, which makes the groups runs again, and
`perm`: column j of q is checkpoint column perm[j], so the layer feeds its
kernel x[..., perm] (as vLLM's exllama and marlin kernels do).

A tensor-parallel rank of a row-parallel layer owns a slice of checkpoint columns, which holds a few columns
of every group. Its slice keeps each group's columns as a run, padded to whole kernel groups of
gcd(group_size, 32) columns (the group's scale repeated) whose padding columns read a zero input, perm entry
`inputs`; the total is padded to a multiple of 128, as the CUDA int4 kernel needs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass
class GroupQuantWeight:
    q: torch.Tensor          # uint8 [out, in]: one code per weight, unpacked
    scale: torch.Tensor      # float32 [out, in // group_size]
    offset: torch.Tensor     # float32 [out, in // group_size]
    bits: int
    group_size: int
    perm: torch.Tensor | None = None   # int64 [in]: column j of q is checkpoint column perm[j] (act-order)
    inputs: int | None = None          # x's width where perm has padding (entries == inputs read zero)
    # scale and offset are a K-quant's 8-bit codes under a float16 base per 8 groups (GGUF Q4_K/Q5_K): the
    # int4 CPU pack may keep them in that form (kernels/weights/weight_kquant.py); a hint, each block is checked
    k_quant: bool = False

    def __post_init__(self) -> None:
        out, cols = self.q.shape
        groups = (out, cols // self.group_size)
        if cols % self.group_size or tuple(self.scale.shape) != groups or tuple(self.offset.shape) != groups:
            raise ValueError(f"GroupQuantWeight: q {tuple(self.q.shape)}, scale {tuple(self.scale.shape)}, "
                             f"offset {tuple(self.offset.shape)} do not fit group_size {self.group_size}")
        if self.perm is not None and tuple(self.perm.shape) != (cols,):
            raise ValueError(f"GroupQuantWeight: perm has shape {tuple(self.perm.shape)}, expected ({cols},)")

    @property
    def shape(self) -> torch.Size:
        return self.q.shape

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> GroupQuantWeight:
        """Rows (dim 0) or whole groups of columns (dim 1) of the weight: a view, as Tensor.narrow (a regrouped
        copy for a slice of an act-order weight's columns)."""
        if dim == 0:
            return GroupQuantWeight(self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                                    self.offset.narrow(0, start, length), self.bits, self.group_size, self.perm,
                                    self.inputs, self.k_quant)
        if self.perm is not None:
            if (start, length) == (0, self.q.shape[1]) and self.inputs is None:
                return self
            return self._act_order_columns(start, length)
        g = self.group_size
        if start % g or length % g:
            raise ValueError(f"cannot split a weight quantized in groups of {g} columns at column {start} "
                             f"(+{length}): the tensor-parallel split must fall on group boundaries")
        return GroupQuantWeight(self.q.narrow(1, start, length), self.scale.narrow(1, start // g, length // g),
                                self.offset.narrow(1, start // g, length // g), self.bits, g,
                                k_quant=self.k_quant)

    def _act_order_columns(self, start: int, length: int) -> GroupQuantWeight:
        """Checkpoint columns start..start+length of an act-order weight (see the module docstring)."""
        if self.inputs is not None:
            raise ValueError("an act-order weight's columns can be split once, not again")
        g, kg = self.group_size, math.gcd(self.group_size, 32)
        perm = self.perm
        kept = ((perm >= start) & (perm < start + length)).nonzero().squeeze(1)   # still in group order
        group = kept // g
        counts = torch.bincount(group, minlength=self.scale.shape[1])           # kept columns per group
        padded = (counts + kg - 1) // kg * kg
        rank_in_group = torch.arange(len(kept), device=perm.device) - (torch.cumsum(counts, 0) - counts)[group]
        dest = (torch.cumsum(padded, 0) - padded)[group] + rank_in_group
        total = int(padded.sum())
        width = (total + 127) // 128 * 128
        groups = torch.arange(len(counts), device=perm.device)
        owner = torch.repeat_interleave(groups, padded // kg)                  # each kernel group's group
        q = self.q.new_full((self.q.shape[0], width), 8)
        q[:, dest] = self.q[:, kept]
        new_perm = perm.new_full((width,), length)
        new_perm[dest] = perm[kept] - start
        tail = self.scale.new_zeros(self.scale.shape[0], (width - total) // kg)    # padding groups: w = 0
        scale, offset = (torch.cat((t[:, owner], tail), 1) for t in (self.scale, self.offset))
        return GroupQuantWeight(q, scale, offset, self.bits, kg, new_perm, length)

    def copy_(self, src: GroupQuantWeight) -> None:
        if src.perm is not None:
            raise ValueError("cannot copy a gptq act-order (desc_act) weight into a preallocated one")
        if (src.bits, src.group_size) != (self.bits, self.group_size):
            raise ValueError(f"cannot load a {src.bits}-bit weight in groups of {src.group_size} into a "
                             f"{self.bits}-bit one in groups of {self.group_size}")
        self.q.copy_(src.q)
        self.scale.copy_(src.scale)
        self.offset.copy_(src.offset)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The float weight [out, in] in the checkpoint's column order (act-order columns put back)."""
        g = self.group_size
        w = self.q.float() * self.scale.repeat_interleave(g, 1) + self.offset.repeat_interleave(g, 1)
        if self.perm is not None:
            inputs = w.shape[1] if self.inputs is None else self.inputs
            # Padding columns all land in the extra last column, which is dropped.
            w = w.new_zeros(w.shape[0], inputs + 1).index_copy_(1, self.perm, w)[:, :inputs]
        return w.to(dtype)

    @staticmethod
    def empty(out: int, cols: int, bits: int, group_size: int) -> GroupQuantWeight:
        groups = cols // group_size
        return GroupQuantWeight(torch.empty(out, cols, dtype=torch.uint8),
                                torch.empty(out, groups, dtype=torch.float32),
                                torch.empty(out, groups, dtype=torch.float32), bits, group_size)
