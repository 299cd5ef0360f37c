"""Poolers: one vector per sequence from its final hidden states (vLLM's pooler.py, small), and what a
pooling task does with it (normalize, Matryoshka truncation, classifier activations)."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.common.pooler_config import PoolerConfig
from pagedserve.common.params.pooling_params import PoolingParams


def pool(hidden: torch.Tensor, starts: list[int], ends: list[int], pooling_type: str) -> torch.Tensor:
    """Sequence r's tokens are hidden[starts[r]:ends[r]]; -> [R, hidden] in float32. LAST: the last token's
    state; CLS: the first's; MEAN: the mean over all of them (the whole prompt is in the step)."""
    if pooling_type == "LAST":
        return hidden[torch.tensor([e - 1 for e in ends], device=hidden.device)].float()
    if pooling_type == "CLS":
        return hidden[torch.tensor(starts, device=hidden.device)].float()
    if pooling_type == "MEAN":      # one segment sum over the rows' tokens, not a loop of small means
        lengths = torch.tensor([e - s for s, e in zip(starts, ends)], device=hidden.device)
        tokens = torch.cat([torch.arange(s, e, device=hidden.device) for s, e in zip(starts, ends)])
        rows = torch.repeat_interleave(torch.arange(len(starts), device=hidden.device), lengths)
        sums = torch.zeros(len(starts), hidden.shape[1], dtype=torch.float32, device=hidden.device)
        return sums.index_add_(0, rows, hidden[tokens].float()) / lengths[:, None]
    raise ValueError(f"pooling type {pooling_type!r} is none of LAST, CLS, MEAN")


def embed_output(vector: torch.Tensor, params: PoolingParams, config: PoolerConfig) -> torch.Tensor:
    """An embedding as asked: Matryoshka-truncated first, then L2-normalized (as vLLM and
    sentence-transformers' truncate_dim do); `encode` is the pooler's raw vector."""
    if params.task == "encode":
        return vector
    if params.dimensions is not None:
        vector = vector[..., :params.dimensions]
    normalize = config.normalize if params.normalize is None else params.normalize
    return F.normalize(vector, p=2, dim=-1) if normalize else vector


def classify_output(logits: torch.Tensor, params: PoolingParams) -> torch.Tensor:
    """Class probabilities: softmax over the labels, sigmoid for a single label (a cross-encoder's score, as
    sentence-transformers' CrossEncoder); raw logits with use_activation=False or task encode."""
    if params.task == "encode" or params.use_activation is False:
        return logits.float()
    return torch.sigmoid(logits.float()) if logits.shape[-1] == 1 else logits.float().softmax(-1)
