"""Vocabulary-parallel embedding and LM head."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.parallel_state import TPGroup


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the vocabulary (padded so slices are equal)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.shard = -(-vocab_size // tp.size)
        self.start = tp.rank * self.shard
        self.weight = nn.Parameter(torch.empty(self.shard, hidden), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        if loaded.shape[0] != self.vocab_size or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding shape {tuple(loaded.shape)} does not match "
                             f"({self.vocab_size}, {param.shape[1]})")
        rows = max(0, min(self.shard, self.vocab_size - self.start))
        param.data[:rows].copy_(loaded[self.start:self.start + rows])
        param.data[rows:].zero_()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        inside = (local >= 0) & (local < self.shard)
        out = F.embedding(local.masked_fill(~inside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(~inside.unsqueeze(-1), 0.0))


class ParallelLMHead(VocabParallelEmbedding):
    def tie(self, embedding: VocabParallelEmbedding) -> None:
        self.weight = embedding.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden, self.weight)
        return self.tp.all_gather(logits, dim=-1)[:, :self.vocab_size].float()
