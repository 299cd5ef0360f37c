"""Token sampling: raw logprobs, min_tokens, penalties, greedy, temperature, min-p, top-k/top-p."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor.sampling_metadata import SamplerOutput, SamplingMetadata


class Sampler(nn.Module):
    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1) if meta.max_num_logprobs is not None else None
        logits = logits.clone()
        for row, blocked in meta.min_tokens_blocked.items():
            logits[row, blocked] = float("-inf")
        if not meta.no_penalties:
            logits = apply_penalties(logits, meta)
        if meta.all_greedy:
            sampled = logits.argmax(dim=-1)
        else:
            sampled = self._sample(logits, meta)
        out = SamplerOutput(sampled_token_ids=sampled.to(torch.int64))
        if raw_logprobs is not None:
            self._gather_logprobs(out, raw_logprobs, meta.max_num_logprobs)
        return out

    @staticmethod
    def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        greedy = logits.argmax(dim=-1)
        temp = meta.temperature.clamp_min(1e-5).unsqueeze(1)   # greedy rows are replaced below
        probs = torch.softmax(logits / temp, dim=-1)
        if meta.min_p is not None:
            probs = _apply_min_p(probs, meta.min_p)
        if meta.top_k is not None or meta.top_p is not None:
            probs = _apply_top_k_top_p(probs, meta.top_k, meta.top_p)
        sampled = _exponential_race(probs, meta.generators)
        if not meta.all_random:
            sampled = torch.where(meta.temperature == 0, greedy, sampled)
        return sampled

    @staticmethod
    def _gather_logprobs(out: SamplerOutput, raw: torch.Tensor, k: int) -> None:
        sampled = out.sampled_token_ids.unsqueeze(1)
        chosen = raw.gather(1, sampled)
        out.sampled_ranks = (raw > chosen).sum(dim=1) + 1
        if k > 0:
            top_lp, top_ids = raw.topk(k, dim=-1)
            out.logprob_token_ids = torch.cat([sampled, top_ids], dim=1)
            out.logprobs = torch.cat([chosen, top_lp], dim=1)
        else:
            out.logprob_token_ids, out.logprobs = sampled, chosen


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """vLLM's definitions: repetition over prompt+output tokens, frequency/presence over output tokens."""
    n, vocab = logits.shape
    out_counts = _token_counts(meta.output_token_ids, n, vocab, logits.device)
    seen = out_counts > 0
    seen |= _token_counts(meta.prompt_token_ids, n, vocab, logits.device) > 0
    rep = meta.repetition_penalties.unsqueeze(1).expand_as(logits)
    scale = torch.where(logits > 0, 1.0 / rep, rep)
    logits = torch.where(seen, logits * scale, logits)
    logits = logits - meta.frequency_penalties.unsqueeze(1) * out_counts
    return logits - meta.presence_penalties.unsqueeze(1) * (out_counts > 0).float()


def _token_counts(rows: list[list[int]], n: int, vocab: int, device: torch.device) -> torch.Tensor:
    counts = torch.zeros(n, vocab, dtype=torch.float32, device=device)
    lengths = [len(r) for r in rows]
    if sum(lengths):
        row_idx = torch.repeat_interleave(torch.arange(n, device=device), torch.tensor(lengths, device=device))
        tok_idx = torch.tensor([t for r in rows for t in r], dtype=torch.int64, device=device)
        counts.index_put_((row_idx, tok_idx), torch.ones_like(tok_idx, dtype=torch.float32), accumulate=True)
    return counts


def _apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return probs.masked_fill(probs < threshold, 0.0)


def _apply_top_k_top_p(probs: torch.Tensor, top_k: torch.Tensor | None,
                       top_p: torch.Tensor | None) -> torch.Tensor:
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    vocab = probs.shape[-1]
    ranks = torch.arange(vocab, device=probs.device).unsqueeze(0)
    drop = torch.zeros_like(sorted_probs, dtype=torch.bool)
    if top_k is not None:
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab)).unsqueeze(1)
        drop |= ranks >= k
    if top_p is not None:
        kept = sorted_probs.masked_fill(drop, 0.0)
        kept = kept / kept.sum(dim=-1, keepdim=True)
        # Drop a token when the mass before it already reaches p; the top token always stays.
        before = kept.cumsum(dim=-1) - kept
        drop |= before >= top_p.unsqueeze(1)
        drop[:, 0] = False
    sorted_probs = sorted_probs.masked_fill(drop, 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)


def _exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) samples from p; seeded rows draw q from their own generator."""
    q = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        q[row].exponential_(generator=gen)
    return (probs / q).argmax(dim=-1)
