"""The token constraints a request carries (logit_bias, allowed_token_ids, bad_words), applied to its
logits row. Only rows that have one pay anything: their device tensors are built on the first step that
needs them and kept for the request's life; per step the work is one scatter per kind of constraint."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from pagedserve.common.params.sampling_params import SamplingParams

_NEG_INF = float("-inf")


@dataclass
class RowConstraints:
    bias: dict[int, float]
    allowed: list[int]
    bad_words: list[list[int]]
    _bias_ids: Optional[torch.Tensor] = field(default=None, repr=False)
    _bias_values: Optional[torch.Tensor] = field(default=None, repr=False)
    _banned_mask: Optional[torch.Tensor] = field(default=None, repr=False)

    @classmethod
    def of(cls, params: SamplingParams) -> Optional["RowConstraints"]:
        """None when the request has no constraint (the common case)."""
        bias, allowed, words = params.logit_bias, params.allowed_token_ids, params._bad_words_token_ids
        if not (bias or allowed or words):
            return None
        return cls(dict(bias or {}), list(allowed or []), [list(w) for w in words or []])

    def bias_tensors(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if self._bias_ids is None:
            self._bias_ids = torch.tensor(list(self.bias), dtype=torch.int64, device=device)
            self._bias_values = torch.tensor(list(self.bias.values()), dtype=torch.float32, device=device)
        return self._bias_ids, self._bias_values

    def banned_mask(self, vocab: int, device: torch.device) -> torch.Tensor:
        """[vocab] bool, True for every id outside allowed_token_ids."""
        if self._banned_mask is None:
            mask = torch.ones(vocab, dtype=torch.bool, device=device)
            mask[torch.tensor(self.allowed, dtype=torch.int64, device=device)] = False
            self._banned_mask = mask
        return self._banned_mask

    def banned_by_bad_words(self, output_token_ids: list[int]) -> list[int]:
        """The last token of each bad word whose other tokens end the output so far (vLLM's rule)."""
        banned = []
        for word in self.bad_words:
            prefix = len(word) - 1
            if prefix > len(output_token_ids):
                continue
            if prefix == 0 or output_token_ids[-prefix:] == word[:prefix]:
                banned.append(word[-1])
        return banned


# (logits row, its constraints, its output token ids so far)
ConstrainedRow = tuple[int, RowConstraints, list[int]]


def apply_constraints(logits: torch.Tensor, rows: list[ConstrainedRow]) -> torch.Tensor:
    """Out-of-place: allowed_token_ids, then bad_words, then logit_bias (vLLM's order)."""
    logits = logits.clone()
    device, vocab = logits.device, logits.shape[-1]
    allowed = [(row, c) for row, c, _ in rows if c.allowed]
    if allowed:
        index = torch.tensor([row for row, _ in allowed], device=device)
        masks = torch.stack([c.banned_mask(vocab, device) for _, c in allowed])
        logits[index] = logits[index].masked_fill(masks, _NEG_INF)
    bad = [(row, tok) for row, c, out in rows if c.bad_words for tok in c.banned_by_bad_words(out)]
    if bad:
        index = (torch.tensor([r for r, _ in bad], device=device), torch.tensor([t for _, t in bad], device=device))
        logits.index_put_(index, torch.tensor(_NEG_INF, device=device))
    biased = [(row, *c.bias_tensors(device)) for row, c, _ in rows if c.bias]
    if biased:
        row_index = torch.cat([torch.full_like(ids, row) for row, ids, _ in biased])
        ids = torch.cat([ids for _, ids, _ in biased])
        values = torch.cat([values for _, _, values in biased])
        logits.index_put_((row_index, ids), values, accumulate=True)
    return logits
