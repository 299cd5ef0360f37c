"""LoRA on a linear layer: a fixed pool of adapter slots, and the batched shrink/expand over a step's tokens.

Each slot holds one adapter's pieces for this layer, packed so that one shrink and one expand serve every
piece of a merged layer (q, k and v; gate and up): A is [pieces * r, in], the pieces' A stacked; B is
[out, pieces * r], block-structured (piece i's B in its own output rows and its own r columns, zeros elsewhere),
with the adapter's scaling folded in, and kept transposed (`b_t`, [pieces * r, out]: the CPU kernels' expand
then sums rows of it, 16 output columns at a time). A token's delta is (x A^T) B^T. The pool's shape never
changes with the adapters in it (what CUDA graphs need, and the C decode step, which keeps pointers into it:
`c_pool`); a slot with a smaller rank uses its first pieces * r rows.

Tensor parallelism follows the base layer's own `shard`: a column-parallel layer keeps A whole and B's rows of
this rank's output slice; a row-parallel layer keeps the columns of A of this rank's input slice and B whole, and
its partial delta is added before the layer's all-reduce, which sums it with the base's partial products.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedserve.kernels.cpu_decode_step import LoraPool
from pagedserve.kernels.cpu_lora import lora_bgmv


@dataclass
class LoRAContext:
    """The step's token -> slot grouping, shared by every LoRA layer of the model; set once per step.

    groups: runs of at least LONG_RUN tokens of one slot (a prefill chunk, or a batch of one adapter): slices,
    no copy. `padded`: the other tokens (decode rows of several adapters, interleaved), gathered into one
    [slots, most tokens, in] block so that two batched matmuls serve every adapter, instead of a gather, two
    matmuls and a scatter per slot; long runs stay out of it, or every slot would be padded to their length."""
    groups: list[tuple[int, tuple[int, int]]] = field(default_factory=list)
    padded: PaddedRows | None = None
    short_slots: torch.Tensor | None = None     # CPU: each token's slot for the C kernel, -1 outside `padded`
    short_order: torch.Tensor | None = None     # CPU: `padded`'s tokens sorted by slot, int32 (the C kernel's)
    row_slots: torch.Tensor | None = None       # CPU: every token's slot, int32 (the C decode step's)
    # CUDA: each token's slot (-1: none) on the device, for the Triton kernels (kernels/triton_lora.py).
    token_slots: torch.Tensor | None = None

    def set_rows(self, token_slots: list[int], device: torch.device) -> None:
        if device.type == "cuda":
            self.token_slots = torch.tensor(token_slots, dtype=torch.int32).to(device, non_blocking=True)
        else:
            self.row_slots = torch.tensor(token_slots, dtype=torch.int32)
        self.groups, short = [], {}
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
        self.short_slots = self.short_order = None
        if short and device.type == "cpu":
            marks = [-1] * len(token_slots)
            for slot, rows in short.items():
                for row in rows:
                    marks[row] = slot
            self.short_slots = torch.tensor(marks, dtype=torch.int32)
            self.short_order = torch.tensor([row for slot in sorted(short) for row in short[slot]], dtype=torch.int32)

    def clear(self) -> None:
        self.groups, self.padded = [], None
        self.token_slots = self.short_slots = self.short_order = self.row_slots = None


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
        if self.context.token_slots is not None:
            from pagedserve.kernels.triton_lora import lora_delta
            lora_delta(x.reshape(-1, x.shape[-1]), self.a, self.b, self.context.token_slots, y.view(-1, y.shape[-1]))
            return y
        for slot, (start, end) in self.context.groups:
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
        padded, ctx = self.context.padded, self.context
        if padded is not None and not (ctx.short_slots is not None and lora_bgmv(
                x, self.a, self.b_t, ctx.short_slots, ctx.short_order, self.widths, self.bounds_t, y)):
            self._apply_padded(x, y, padded)
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
