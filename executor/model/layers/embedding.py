"""Vocabulary-parallel token embedding and LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.kernels import ops


class VocabParallelEmbedding(nn.Module):
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
        self.weight = nn.Parameter(torch.empty(self.shard_size, hidden_size), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor,
                      shard_id: int | str | None = None) -> None:
        if tuple(loaded_weight.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(f"{type(self).__name__}: checkpoint shape {tuple(loaded_weight.shape)} does not "
                             f"match (vocab_size={self.vocab_size}, hidden={param.shape[1]})")
        rows = max(0, min(self.shard_size, self.vocab_size - self.vocab_start))
        param.data[:rows].copy_(loaded_weight[self.vocab_start:self.vocab_start + rows])
        param.data[rows:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        # Other ranks own these ids: contribute zeros to the sum.
        return self.tp.all_reduce(out.masked_fill_(outside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    """hidden -> logits over the full vocabulary (each rank computes its slice, then all_gather)."""

    def tie(self, embedding: VocabParallelEmbedding) -> None:
        """Share the embedding's weight (tie_word_embeddings): one tensor, loaded once."""
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(f"ParallelLMHead.tie: embedding shape {tuple(embedding.weight.shape)} does not "
                             f"match the head's {tuple(self.weight.shape)}")
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size], identical on every rank."""
        logits = ops.linear(hidden, self.weight)
        if self.tp.size > 1:
            logits = self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size]
        return logits.float()
