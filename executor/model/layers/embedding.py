"""Vocabulary-parallel token embedding and LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.model.layers.linear_method import LinearMethod, dense_linear_method, linear_method_for
from pagedserve.executor.model.layers.packed_pieces import PackedPieces
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.executor.model.quant.packing import Packed, Piece, pack_embedding, pack_linear
from pagedserve.kernels.weights.weight_only import Int4Weight, Int8Weight, int4_embedding, int8_embedding


class VocabParallelEmbedding(PackedPieces, nn.Module):
    """Each rank holds a contiguous slice of the vocabulary.

    Slices are ceil(vocab_size / tp) rows so every rank has the same shape (all_gather needs it);
    the last rank's padding rows are zero and are trimmed from logits.
    """

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard_size = -(-vocab_size // tp.size)
        self.vocab_start = tp.rank * self.shard_size
        self.hidden_size = hidden_size
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.packed: Packed | None = None        # quantized checkpoints: int8 or int4 (packing.pack_embedding)
        self._pieces: list[Piece] | None = None

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: int | str | None = None) -> None:
        if tuple(loaded_weight.shape) != (self.vocab_size, self.hidden_size):
            raise ValueError(f"{type(self).__name__}: checkpoint shape {tuple(loaded_weight.shape)} does not "
                             f"match (vocab_size={self.vocab_size}, hidden={self.hidden_size})")
        rows = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        if self._pieces is not None:          # the padding rows are zero-filled when packing
            self._pieces.append((0, loaded_weight.narrow(0, self.vocab_start, rows)))
            return
        param.data[:rows].copy_(loaded_weight[self.vocab_start:self.vocab_start + rows])
        param.data[rows:].zero_()

    def piece_rows(self) -> int:
        """Rows the pieces of a complete table cover (the padding rows past the vocabulary are zero-filled)."""
        return max(0, min(self.shard_size, self.vocab_size - self.vocab_start))

    def finish_packed_load(self, method: str, device: torch.device, dtype: torch.dtype) -> bool:
        """Pack the collected pieces; nothing when none came (packed already: a tied head asked for it first).
        True when the table's tensors were replaced rather than overwritten in place."""
        pieces = self.take_pieces()
        if not pieces:
            return False
        self.out_dtype = dtype
        return self._install_form(pack_embedding(pieces, self.shard_size, method, device, dtype,
                                                 type(self).__name__), device)

    def _lookup(self, ids: torch.Tensor) -> torch.Tensor:
        if isinstance(self.packed, Int8Weight):
            return int8_embedding(ids, self.packed, self.out_dtype)
        if isinstance(self.packed, Int4Weight):
            return int4_embedding(ids, self.packed, self.out_dtype)
        return F.embedding(ids, self.weight)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return self._lookup(input_ids)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = self._lookup(local.masked_fill(outside, 0))
        # Other ranks own these ids: contribute zeros to the sum.
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary (each rank computes its slice, then all_gather).

    A linear layer too: its method (layers/linear_method.py) is picked when it is built and again when its
    weight is packed; a tied head runs the embedding's table (`weight` / `packed` are the embedding's)."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TPGroup) -> None:
        super().__init__(vocab_size, hidden_size, tp)
        self.method: LinearMethod = dense_linear_method(self.weight.device)

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): one tensor, loaded once."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(f"ParallelLMHead.tie: embedding shape {tuple(embedding.weight.shape)} does not "
                             f"match the head's {tuple(self.weight.shape)}")
        self.weight = embedding.weight
        self.tied_to = embedding

    def begin_packed_load(self) -> None:
        source = getattr(self, "tied_to", None)
        if source is None:
            super().begin_packed_load()
            return
        if source._pieces is None:
            source.begin_packed_load()
        self.weight = source.weight          # still one shared (placeholder) parameter

    def begin_packed_update(self, pieces: list | None = None) -> None:
        if getattr(self, "tied_to", None) is None:       # a tied head's table is the embedding's to collect
            super().begin_packed_update(pieces)

    def finish_packed_load(self, method: str, device: torch.device, dtype: torch.dtype) -> bool:
        source = getattr(self, "tied_to", None)
        if source is None:
            pieces = self.take_pieces()
            if not pieces:
                return False
            replaced = self._install_form(pack_linear(pieces, self.shard_size, method, device, dtype,
                                                      type(self).__name__), device)
        else:                                # the embedding packs the one shared table
            replaced = source.finish_packed_load(method, device, dtype)
            self.weight, self.packed = source.weight, source.packed
        self.method = linear_method_for(self.weight if self.packed is None else self.packed, device)
        return replaced

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size], identical on every rank."""
        logits = self.method.apply(self, hidden, None)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]
        return logits.float()
