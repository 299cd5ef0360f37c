"""LoRA on a linear layer: a fixed pool of adapter slots, and the batched shrink/expand over a step's tokens.

Each slot holds one adapter's pieces for this layer, packed so that one shrink and one expand serve every
piece of a merged layer (q, k and v; gate and up): A is [pieces * r, in], the pieces' A stacked; B is
[out, pieces * r], block-structured (piece i's B in its own output rows and its own r columns, zeros elsewhere),
with the adapter's scaling folded in, and kept transposed (`b_t`, [pieces * r, out]: the CPU kernels' expand
then sums rows of it, 64 output columns at a time). A token's delta is (x A^T) B^T. The pool's shape never
changes with the adapters in it (what CUDA graphs need, and the C decode step, which keeps pointers into it:
`c_pool`); a slot with a smaller rank uses its first pieces * r rows.

Tensor parallelism follows the base layer's own `shard`: a column-parallel layer keeps A whole and B's rows of
this rank's output slice; a row-parallel layer keeps the columns of A of this rank's input slice and B whole, and
its partial delta is added before the layer's all-reduce, which sums it with the base's partial products.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.kernels.cpu.decode_step import LoraPool
from pagedserve.kernels.cpu.lora import lora_bgmv


@dataclass
class LoRAContext:
    """The step's token -> slot map, shared by every LoRA layer of the model; set once per step. A layer applies
    it one of three ways:

    - CUDA: `token_slots` on the device, for the Triton kernels (kernels/triton/lora.py).
    - CPU with the C kernel (`cpu_kernel`: float32 activations, kernels/cpu/csrc/lora.c built): `order`, the adapter
      tokens sorted by slot, in one call a layer, long runs (a prefill chunk) too: on the embedded model it ran
      a 256-token run of one adapter in 0.47 ms for a layer's four linears against 0.67 for torch's matmuls
      (bfloat16 slots, one thread), and 64 tokens in 0.12 against 0.34.
    - else torch: `groups`, runs of at least LONG_RUN tokens of one slot, as slices (no copy); `padded`, the other
      tokens (decode rows of several adapters, interleaved), gathered into one [slots, most tokens, in] block so
      that two batched matmuls serve every adapter; long runs stay out of it, or every slot would be padded to
      their length.

    `row_slots` (CPU), every token's slot, is the C kernel's map and the C decode step's
    (executor/model/models/llama_cpu_step.py)."""
    cpu_kernel: bool = False
    groups: list[tuple[int, tuple[int, int]]] = field(default_factory=list)
    padded: PaddedRows | None = None
    row_slots: torch.Tensor | None = None       # CPU: every token's slot, int32 (-1: the base model)
    order: torch.Tensor | None = None           # cpu_kernel: the adapter tokens sorted by slot, int32
    token_slots: torch.Tensor | None = None     # CUDA: every token's slot, int32, on the device

    def set_rows(self, token_slots: list[int], device: torch.device) -> None:
        self.clear()
        if device.type == "cuda":
            self.token_slots = torch.tensor(token_slots, dtype=torch.int32).to(device, non_blocking=True)
            return
        self.row_slots = torch.tensor(token_slots, dtype=torch.int32)
        if self.cpu_kernel:
            order = torch.argsort(self.row_slots, stable=True)
            self.order = order[self.row_slots[order] >= 0].to(torch.int32)
            return
        short: dict[int, list[int]] = {}
        start = 0
        for end in range(1, len(token_slots) + 1):
            if end < len(token_slots) and token_slots[end] == token_slots[start]:
                continue
            slot = token_slots[start]
            if slot >= 0 and end - start >= LONG_RUN:
                self.groups.append((slot, (start, end)))
            elif slot >= 0:
                short.setdefault(slot, []).extend(range(start, end))
            start = end
        self.padded = PaddedRows.of(short, len(token_slots), device) if short else None

    def clear(self) -> None:
        self.groups, self.padded = [], None
        self.token_slots = self.row_slots = self.order = None


LONG_RUN = 8


@dataclass
class PaddedRows:
    """Tokens by slot, padded: index[i, j] is the j-th token of slots[i] (num_tokens: a zero row past the end)."""
    slots: list[int]
    index: torch.Tensor          # long [len(slots), most tokens of a slot]
    positions: torch.Tensor      # long: the flat positions of index that hold a real token
    rows: torch.Tensor           # long: the token at each of those positions

    @classmethod
    def of(cls, by_slot: dict[int, list[int]], num_tokens: int, device: torch.device) -> "PaddedRows":
        slots = sorted(by_slot)
        most = max(len(rows) for rows in by_slot.values())
        index = torch.full((len(slots), most), num_tokens, dtype=torch.long)
        positions, rows = [], []
        for i, slot in enumerate(slots):
            index[i, :len(by_slot[slot])] = torch.tensor(by_slot[slot])
            positions += range(i * most, i * most + len(by_slot[slot]))
            rows += by_slot[slot]
        return cls(slots, index.to(device), torch.tensor(positions, device=device), torch.tensor(rows, device=device))


class LoRASlots:
    """The adapter slots of one linear layer."""

    def __init__(self, piece_sizes: list[int], in_features: int, out_features: int, max_loras: int, max_rank: int,
                 context: LoRAContext, dtype: torch.dtype, device: torch.device) -> None:
        """piece_sizes: the output rows of each piece (q, k, v; gate, up; or one), in order."""
        pieces = len(piece_sizes)
        if sum(piece_sizes) != out_features:
            raise ValueError(f"LoRA pieces {piece_sizes} do not add up to the layer's {out_features} outputs")
        self.pieces = pieces
        # Piece i owns output rows bounds[i]:bounds[i + 1] and columns i*r:(i+1)*r of B: the expand multiplies
        # only that block, not the zeros around it.
        self.bounds = [sum(piece_sizes[:i]) for i in range(pieces + 1)]
        self.bounds_t = torch.tensor(self.bounds, dtype=torch.int64)
        self.context = context
        self.a = torch.zeros(max_loras, pieces * max_rank, in_features, dtype=dtype, device=device)
        self.b_t = torch.zeros(max_loras, pieces * max_rank, out_features, dtype=dtype, device=device)
        self.width = [0] * max_loras       # pieces * rank of the adapter in each slot (0: empty)
        self.widths = torch.zeros(max_loras, dtype=torch.int64)     # the same, for the C kernel

    @property
    def b(self) -> torch.Tensor:
        """B as [slots, out, pieces * r] (a view of b_t), the Triton kernels' contract."""
        return self.b_t.transpose(1, 2)

    def c_pool(self) -> LoraPool:
        """The slots as the C decode step reads them, in place (filled by set_slot / clear_slot)."""
        return LoraPool(self.a, self.b_t, self.widths, self.bounds_t)

    def set_slot(self, slot: int, a: torch.Tensor, b: torch.Tensor) -> None:
        """a: [pieces * r, in], b: [out, pieces * r] (scaled), as LoRAManager packs them."""
        width = a.shape[0]
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        self.a[slot, :width].copy_(a)
        self.b_t[slot, :width].copy_(b.T)
        self.width[slot] = width
        self.widths[slot] = width

    def clear_slot(self, slot: int) -> None:
        # Zeros, not just width 0: the CUDA kernels sum the slot's whole width.
        self.a[slot].zero_()
        self.b_t[slot].zero_()
        self.width[slot] = 0
        self.widths[slot] = 0

    def apply(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y (the base layer's output for x, this rank's part) plus each token's adapter delta, in place."""
        ctx = self.context
        if ctx.token_slots is not None:
            from pagedserve.kernels.triton.lora import lora_delta
            lora_delta(x.reshape(-1, x.shape[-1]), self.a, self.b, ctx.token_slots, y.view(-1, y.shape[-1]))
            return y
        if ctx.order is not None:
            if not lora_bgmv(x.contiguous(), self.a, self.b_t, ctx.row_slots, ctx.order, self.widths, self.bounds_t, y):
                raise RuntimeError(f"LoRA: the C kernel declined a step (x {x.dtype} {tuple(x.shape)}, y {y.dtype}); "
                                   f"its context was made for it (LoRAContext.cpu_kernel)")
            return y
        for slot, (start, end) in ctx.groups:
            width = self.width[slot]
            if not width:
                continue
            xa = x[start:end].to(self.a.dtype) @ self.a[slot, :width].T
            rank = width // self.pieces
            for i in range(self.pieces):
                lo, hi, cols = self.bounds[i], self.bounds[i + 1], slice(i * rank, (i + 1) * rank)
                if xa.dtype == y.dtype:     # in place: no [tokens, out] temporary
                    y[start:end, lo:hi].addmm_(xa[:, cols], self.b_t[slot, cols, lo:hi])
                else:                       # bfloat16 slots over a float32 model (LoRAManager's pool_dtype)
                    y[start:end, lo:hi] += xa[:, cols] @ self.b_t[slot, cols, lo:hi]
        if ctx.padded is not None:
            self._apply_padded(x, y, ctx.padded)
        return y

    def _apply_padded(self, x: torch.Tensor, y: torch.Tensor, rows: PaddedRows) -> torch.Tensor:
        width = max(self.width[s] for s in rows.slots)
        if width == 0:
            return y
        first, count = rows.slots[0], len(rows.slots)
        if rows.slots == list(range(first, first + count)):      # slots filled in order: views, no copy
            a, b_t = self.a[first:first + count, :width], self.b_t[first:first + count, :width]
        else:
            picked = torch.tensor(rows.slots, device=x.device)
            a, b_t = self.a[picked, :width], self.b_t[picked, :width]
        gathered = torch.cat([x, x.new_zeros(1, x.shape[-1])])[rows.index].to(a.dtype)   # [slots, most, in]
        delta = torch.bmm(torch.bmm(gathered, a.transpose(1, 2)), b_t).to(y.dtype)      # [slots, most, out]
        return y.index_add_(0, rows.rows, delta.reshape(-1, delta.shape[-1]).index_select(0, rows.positions))


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
