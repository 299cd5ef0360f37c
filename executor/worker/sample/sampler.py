"""Token sampling with vLLM V1 semantics.

Order: raw logprobs -> token constraints (allowed ids, bad words, logit bias) -> min_tokens blocking -> penalties ->
grammar bitmask (structured outputs) -> greedy argmax | temperature -> min-p ->
top-k/top-p -> exponential-race sampling. Every step is batched over rows; only seeded rows get a
Python loop, because each owns its own generator.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor.worker.sample.grammar_mask import apply_grammar
from pagedserve.executor.worker.sample.logit_constraints import apply_constraints
from pagedserve.executor.worker.sample.sampling_metadata import SamplerOutput, SamplingMetadata

_NEG_INF = float("-inf")


class Sampler(nn.Module):
    """logits [n, V] + SamplingMetadata -> SamplerOutput (int64 token ids, optional raw logprobs)."""

    def forward(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        raw_logprobs = None
        if meta.max_num_logprobs is not None:
            # vLLM reports the model's distribution, untouched by any sampling setting.
            raw_logprobs = torch.log_softmax(logits.float(), dim=-1)
        processed = process_logits(logits, meta)
        sampled = _sample(processed, meta)
        out = SamplerOutput(sampled_token_ids=sampled)
        if raw_logprobs is not None:
            _fill_logprobs(out, raw_logprobs, meta.max_num_logprobs)
        return out


# ---------------------------------------------------------------------------------------------
# Logit processing shared by greedy and random rows
# ---------------------------------------------------------------------------------------------

def process_logits(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """float32 logits after token constraints, min_tokens blocking and penalties; never writes into the
    caller's tensor."""
    logits = logits.float()
    if meta.constrained:
        logits = apply_constraints(logits, meta.constrained)
    if meta.min_tokens_blocked:
        logits = apply_min_tokens(logits, meta.min_tokens_blocked)
    if not meta.no_penalties:
        logits = apply_penalties(logits, meta)
    if meta.grammar is not None:
        # Last, so nothing after it can lift a token the grammar forbids (vLLM masks before sampling too).
        logits = apply_grammar(logits, meta.grammar)
    return logits


def apply_min_tokens(logits: torch.Tensor, blocked: dict[int, list[int]]) -> torch.Tensor:
    """Out-of-place: the blocked ids of each row get -inf so they can be neither argmax nor sampled."""
    rows = [row for row, ids in blocked.items() for _ in ids]
    cols = [tok for ids in blocked.values() for tok in ids]
    if not cols:
        return logits
    index = (torch.tensor(rows, device=logits.device), torch.tensor(cols, device=logits.device))
    return logits.index_put(index, torch.tensor(_NEG_INF, device=logits.device))


def apply_penalties(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """Repetition over prompt+output tokens, then frequency and presence over output tokens only."""
    n, vocab = logits.shape
    out_counts = token_counts(meta.output_token_ids, n, vocab, logits.device)
    in_output = out_counts > 0
    seen = in_output | (token_counts(meta.prompt_token_ids, n, vocab, logits.device) > 0)
    rep = torch.where(seen, meta.repetition_penalties.unsqueeze(1), 1.0)
    # Shrinks a seen token's logit toward zero from either side, so p > 1 always discourages it.
    logits = torch.where(logits > 0, logits / rep, logits * rep)
    logits = logits - meta.frequency_penalties.unsqueeze(1) * out_counts
    return logits - meta.presence_penalties.unsqueeze(1) * in_output.float()


def token_counts(rows: list[list[int]], n: int, vocab: int, device: torch.device) -> torch.Tensor:
    """[n, vocab] float32 occurrence counts, built with one scatter_add over a padded id matrix."""
    width = max((len(r) for r in rows), default=0)
    # Ragged rows are padded with an extra bin `vocab` that is sliced off afterwards.
    padded = [list(r) + [vocab] * (width - len(r)) for r in rows] + [[vocab] * width] * (n - len(rows))
    ids = torch.tensor(padded, dtype=torch.int64, device=device).reshape(n, width)
    counts = torch.zeros(n, vocab + 1, dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=device))
    return counts[:, :vocab]


# ---------------------------------------------------------------------------------------------
# Sampling
# ---------------------------------------------------------------------------------------------

def _sample(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    greedy = None if meta.all_random else logits.argmax(dim=-1)
    if meta.all_greedy:
        return greedy
    probs = sampling_probs(logits, meta)
    sampled = exponential_race(probs, meta.generators)
    if greedy is None:
        return sampled
    return torch.where(meta.temperature == 0, greedy, sampled)


def sampling_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The renormalized distribution random rows draw from: temperature, then min-p, then top-k/top-p.

    Greedy rows get a harmless temperature of 1 here; their result is replaced by the argmax.
    """
    temperature = torch.where(meta.temperature == 0, 1.0, meta.temperature)
    logits = logits / temperature.unsqueeze(1)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    if meta.top_k is not None or meta.top_p is not None:
        logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return torch.softmax(logits, dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """-inf for tokens whose probability is below min_p times the row's top probability."""
    probs = torch.softmax(logits, dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, _NEG_INF)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """One descending sort serves both truncations; the drop mask is scattered back to vocab order."""
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    if top_k is not None:
        sorted_logits = _top_k_sorted(sorted_logits, top_k)
    if top_p is not None:
        sorted_logits = _top_p_sorted(sorted_logits, top_p)
    drop = torch.isneginf(sorted_logits)
    return logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), _NEG_INF)


def _top_k_sorted(sorted_logits: torch.Tensor, top_k: torch.Tensor) -> torch.Tensor:
    """Keep logits >= the k-th largest (ties with it stay, as in vLLM); k = 0 keeps everything."""
    vocab = sorted_logits.shape[-1]
    k = torch.where(top_k > 0, top_k, vocab).clamp(max=vocab)
    kth = sorted_logits.gather(1, (k - 1).unsqueeze(1))
    return sorted_logits.masked_fill(sorted_logits < kth, _NEG_INF)


def _top_p_sorted(sorted_logits: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Keep the shortest prefix whose mass reaches p: drop a token once the mass before it is >= p."""
    probs = torch.softmax(sorted_logits, dim=-1)   # renormalized over what top-k / min-p left
    mass_before = probs.cumsum(dim=-1) - probs
    drop = mass_before >= top_p.unsqueeze(1)
    # p = 1 means off; without this, cumsum round-off could clip a tiny tail.
    drop &= (top_p < 1.0).unsqueeze(1)
    drop[:, 0] = False
    return sorted_logits.masked_fill(drop, _NEG_INF)


def exponential_race(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """argmax(p / q) with q ~ Exp(1) i.i.d. picks token i with probability p_i.

    A seeded row draws its q from its own generator, so its tokens do not depend on the batch;
    all other rows share a single draw from the default RNG.
    """
    vocab = probs.shape[-1]
    q = torch.empty_like(probs).exponential_()
    for row, gen in generators.items():
        q[row] = torch.empty(vocab, device=gen.device).exponential_(generator=gen).to(probs.device)
    # A q of exactly 0 would turn a masked 0/0 into NaN, which argmax would pick.
    q.clamp_(min=torch.finfo(q.dtype).tiny)
    return (probs / q).argmax(dim=-1)


# ---------------------------------------------------------------------------------------------
# Logprobs
# ---------------------------------------------------------------------------------------------

def _fill_logprobs(out: SamplerOutput, raw: torch.Tensor, k: int) -> None:
    """Column 0: the sampled token; columns 1..k: the raw top-k, sorted descending."""
    sampled = out.sampled_token_ids.unsqueeze(1)
    chosen = raw.gather(1, sampled)
    out.sampled_ranks = (raw > chosen).sum(dim=-1) + 1
    top_logprobs, top_ids = raw.topk(k, dim=-1)
    out.logprob_token_ids = torch.cat([sampled, top_ids], dim=1)
    out.logprobs = torch.cat([chosen, top_logprobs], dim=1)
