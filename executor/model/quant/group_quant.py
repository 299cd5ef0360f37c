"""The one in-memory form every quantized checkpoint format is decoded to before it is repacked for a kernel.

    w[o, i] = scale[o, i // group_size] * q[o, i] + offset[o, i // group_size]

with unsigned integer codes q in [0, 2**bits). GGUF blocks (Q4_0 ... Q6_K), AWQ and GPTQ all fit it, so the
sharding (tensor parallelism slices rows or whole groups of columns) and the repacking into the int4/int8
kernels' layouts are written once, against this form, whatever the checkpoint was.

GPTQ act-order (desc_act) checkpoints put input column i in group g_idx[i], so a group is not a run of
adjacent columns. They are held with their columns sorted by group, which makes the groups runs again, and
`perm`: column j of q is checkpoint column perm[j], so the layer feeds its
kernel x[..., perm] (as vLLM's exllama and marlin kernels do).
"""
from __future__ import annotations

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
        """Rows (dim 0) or whole groups of columns (dim 1) of the weight: a view, as Tensor.narrow."""
        if dim == 0:
            return GroupQuantWeight(self.q.narrow(0, start, length), self.scale.narrow(0, start, length),
                                    self.offset.narrow(0, start, length), self.bits, self.group_size, self.perm)
        if self.perm is not None:
            if (start, length) == (0, self.q.shape[1]):
                return self
            # A rank's slice of checkpoint columns holds a few columns of every group, not whole groups, which
            # the int4 kernel cannot take; re-splitting by group would need the producer's columns reordered.
            raise ValueError("a gptq act-order (desc_act true) weight cannot have its input columns split "
                             "across tensor-parallel ranks (a row-parallel layer such as o_proj or down_proj): "
                             "use tensor_parallel_size 1, or a checkpoint quantized with desc_act false")
        g = self.group_size
        if start % g or length % g:
            raise ValueError(f"cannot split a weight quantized in groups of {g} columns at column {start} "
                             f"(+{length}): the tensor-parallel split must fall on group boundaries")
        return GroupQuantWeight(self.q.narrow(1, start, length), self.scale.narrow(1, start // g, length // g),
                                self.offset.narrow(1, start // g, length // g), self.bits, g)

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
            w = torch.empty_like(w).index_copy_(1, self.perm, w)
        return w.to(dtype)

    @staticmethod
    def empty(out: int, cols: int, bits: int, group_size: int) -> GroupQuantWeight:
        groups = cols // group_size
        return GroupQuantWeight(torch.empty(out, cols, dtype=torch.uint8),
                                torch.empty(out, groups, dtype=torch.float32),
                                torch.empty(out, groups, dtype=torch.float32), bits, group_size)
