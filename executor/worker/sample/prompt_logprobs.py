"""Prompt logprobs (vLLM's SamplingParams.prompt_logprobs): score every prompt token given the ones before it.

The runner computes logits only for the last token of each row; a row that asked for prompt logprobs also gets
logits for the positions of its prompt chunk this step, so chunked prefill scores a prompt piece by piece and
rows that did not ask pay nothing. Position p's hidden state predicts token p + 1, so the last prompt position
scores nothing here (its prediction is the first generated token, which the sampler reports).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.ipc.messages import LogprobsEntry, PromptLogprobsChunk

# Positions scored per lm_head call: bounds the [positions, vocab] float32 logits a long prompt chunk would take.
_SLICE = 256


@dataclass
class _RowSpan:
    req_id: str
    start: int              # first prompt position scored (its target is token start + 1)
    token_index: int        # where that position's hidden state sits in the flat batch
    targets: list[int]      # the prompt tokens scored, in order
    k: int                  # top logprobs wanted


def _spans(req_ids: Sequence[str], states: dict[str, CachedRequestState], query_start: Sequence[int],
           seq_lens: Sequence[int]) -> list[_RowSpan]:
    spans = []
    for i, rid in enumerate(req_ids):
        state = states[rid]
        k = state.sampling_params.prompt_logprobs
        if k is None:
            continue
        count = query_start[i + 1] - query_start[i]
        start = seq_lens[i] - count                            # num_computed_tokens before this step
        end = min(seq_lens[i], state.num_prompt_tokens - 1)    # exclusive: positions with a prompt target
        if end > start:
            spans.append(_RowSpan(rid, start, query_start[i], state.token_ids[start + 1:end + 1], k))
    return spans


def compute_prompt_logprobs(model: nn.Module, hidden: torch.Tensor, req_ids: Sequence[str],
                            states: dict[str, CachedRequestState], query_start: Sequence[int],
                            seq_lens: Sequence[int]) -> dict[str, PromptLogprobsChunk] | None:
    """This step's prompt logprobs of every row that asked for them (None when no row did)."""
    spans = _spans(req_ids, states, query_start, seq_lens)
    if not spans:
        return None
    return {s.req_id: PromptLogprobsChunk(start=s.start, entries=_score(model, hidden, s)) for s in spans}


def _score(model: nn.Module, hidden: torch.Tensor, span: _RowSpan) -> list[LogprobsEntry]:
    entries: list[LogprobsEntry] = []
    for lo in range(0, len(span.targets), _SLICE):
        targets = span.targets[lo:lo + _SLICE]
        first = span.token_index + lo
        logits = model.compute_logits(hidden[first:first + len(targets)])
        entries.extend(score_targets(logits, torch.tensor(targets, device=logits.device), span.k))
    return entries


def score_targets(logits: torch.Tensor, targets: torch.Tensor, k: int) -> list[LogprobsEntry]:
    """Per row: the target's float32 logprob, its 1-based rank in the whole vocabulary, then the top-k."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.unsqueeze(1))
    ranks = ((logprobs > chosen).sum(dim=-1) + 1).tolist()
    top_lps, top_ids = logprobs.topk(k, dim=-1) if k > 0 else (logprobs[:, :0], targets[:, None][:, :0])
    ids = torch.cat([targets.unsqueeze(1), top_ids], dim=1).tolist()
    lps = torch.cat([chosen, top_lps], dim=1).tolist()
    return [LogprobsEntry(token_ids=i, logprobs=lp, sampled_rank=r) for i, lp, r in zip(ids, lps, ranks)]
