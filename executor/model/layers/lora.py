"""LoRA on a linear layer: a fixed pool of adapter slots, and the batched shrink/expand over a step's tokens.

Each slot holds one adapter's pieces for this layer, packed so that one shrink and one expand serve every
piece of a merged layer (q, k and v; gate and up): A is [pieces * r, in], the pieces' A stacked; B is
[out, pieces * r], block-structured (piece i's B in its own output rows and its own r columns, zeros elsewhere),
with the adapter's scaling folded in. A token's delta is then (x A^T) B^T. The pool's shape never changes with
the adapters in it (what CUDA graphs need); a slot with a smaller rank uses its first pieces * r rows.

Tensor parallelism follows the base layer's own `shard`: a column-parallel layer keeps A whole and B's rows of
this rank's output slice; a row-parallel layer keeps the columns of A of this rank's input slice and B whole, and
its partial delta is added before the layer's all-reduce, which sums it with the base's partial products.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRAContext:
    """The step's token -> slot grouping, shared by every LoRA layer of the model; set once per step.

    groups: (slot, rows) where rows is a (start, end) range when the slot's tokens are contiguous (a slice, no
    copy), else an index tensor (gather, then index_add)."""
    groups: list[tuple[int, tuple[int, int] | torch.Tensor]] = field(default_factory=list)
    # CUDA: each token's slot (-1: none) on the device, for the Triton kernels (kernels/triton_lora.py).
    token_slots: torch.Tensor | None = None

    def set_rows(self, token_slots: list[int], device: torch.device) -> None:
        if device.type == "cuda":
            self.token_slots = torch.tensor(token_slots, dtype=torch.int32).to(device, non_blocking=True)
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(token_slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(i)
        self.groups = []
        for slot, rows in by_slot.items():
            if rows[-1] - rows[0] + 1 == len(rows):
                self.groups.append((slot, (rows[0], rows[-1] + 1)))
            else:
                self.groups.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))

    def clear(self) -> None:
        self.groups = []
        self.token_slots = None


class LoRASlots:
    """The adapter slots of one linear layer."""

    def __init__(self, pieces: int, in_features: int, out_features: int, max_loras: int, max_rank: int,
                 context: LoRAContext, dtype: torch.dtype, device: torch.device) -> None:
        self.pieces = pieces
        self.context = context
        self.a = torch.zeros(max_loras, pieces * max_rank, in_features, dtype=dtype, device=device)
        self.b = torch.zeros(max_loras, out_features, pieces * max_rank, dtype=dtype, device=device)
        self.width = [0] * max_loras       # pieces * rank of the adapter in each slot (0: empty)

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a: [pieces * r, in], b: [out, pieces * r] (scaled), as LoRAManager packs them."""
        width = a.shape[0]
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.a[slot, :width].copy_(a)
        self.b[slot, :, :width].copy_(b)
        self.width[slot] = width

    def clear_slot(self, slot: int) -> None:
        # Zeros, not just width 0: the CUDA kernels sum the slot's whole width.
        self.a[slot].zero_()
        self.b[slot].zero_()
        self.width[slot] = 0

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x, this rank's part) plus each token's adapter delta, in place."""
        if self.context.token_slots is not None:
            from pagedserve.kernels.triton_lora import lora_delta
            lora_delta(x.reshape(-1, x.shape[-1]), self.a, self.b, self.context.token_slots, y.view(-1, y.shape[-1]))
            return y
        for slot, rows in self.context.groups:
            width = self.width[slot]
            if width == 0:
                continue
            a, b = self.a[slot, :width], self.b[slot, :, :width]
            if isinstance(rows, tuple):
                start, end = rows
                y[start:end] += (x[start:end] @ a.T) @ b.T
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y


def pack_pieces(pieces: list[tuple[torch.Tensor, int, torch.Tensor] | None], rank: int, in_features: int,
                out_features: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """One adapter's (A, B) for a layer from its pieces: each (A_i [r, in], B's first output row, B_i [rows, r])
    in this rank's layout, None for a piece the adapter leaves alone (zeros)."""
    n = len(pieces)
    a = torch.zeros(n * rank, in_features, dtype=dtype)
    b = torch.zeros(out_features, n * rank, dtype=dtype)
    for i, piece in enumerate(pieces):
        if piece is None:
            continue
        a_i, row, b_i = piece
        a[i * rank:(i + 1) * rank].copy_(a_i)
        b[row:row + b_i.shape[0], i * rank:(i + 1) * rank].copy_(b_i)
    return a, b
