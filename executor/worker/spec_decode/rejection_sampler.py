"""Verify a row's draft tokens against the target model's logits at each of its k + 1 positions.

Position j of a row sees the request as if drafts d1..dj had been sampled: its penalties, min_tokens, logit
bias and seeded generator are those of that output position (one virtual request state per position), so a
draft is judged by exactly the distribution a one-token step would sample it from.

- Greedy rows accept drafts while they equal the argmax; the token after them is the argmax: token for token
  what decoding without drafts gives.
- Random rows: rejection sampling (Leviathan et al.) with one-hot drafts (ngram, and the greedy drafts of a
  draft model or head): accept d with probability min(1, p(d) / q(d)) = p(d); on rejection sample from
  norm(max(0, p - q)), which is p without d; when every draft is accepted, sample one more from the last
  position. The output distribution is the target's. It is done by sampling every position from p as a
  one-token step would and accepting the drafts while they equal the samples (`_rejection`), so a seeded
  request's tokens do not depend on how many drafts ran.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from pagedserve.executor.worker.sample.grammar_mask import GrammarRows
from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.sample.sampler import exponential_race, process_logits, sampling_probs
from pagedserve.executor.worker.sample.sampling_inputs import build_sampling_metadata
from pagedserve.ipc.messages import LogprobsEntry


@dataclass
class VerifiedRow:
    accepted: list[int]                        # the drafts taken, in order
    token: int                                 # the token sampled after them (recovered or bonus)
    entries: list[LogprobsEntry] | None        # logprobs of accepted + [token] where the request asked


def _at_position(state: CachedRequestState, drafted: list[int]) -> CachedRequestState:
    """The request as if `drafted` had been sampled: its own generator, seeded for that output position."""
    return dataclasses.replace(
        state, token_ids=state.token_ids + drafted, output_token_ids=state.output_token_ids + drafted,
        generator=torch.Generator() if state.generator is not None else None)


def verify_drafts(logits: torch.Tensor, states: list[CachedRequestState], drafts: list[list[int]],
                  eos_token_ids: tuple[int, ...], device: torch.device,
                  grammar: GrammarRows | None = None) -> list[VerifiedRow]:
    """logits: [sum(len(d) + 1), V], each row's positions in order (its real token's, then each draft's);
    grammar: the mask rows of those positions, for requests under a grammar."""
    virtual = [_at_position(s, d[:j]) for s, d in zip(states, drafts) for j in range(len(d) + 1)]
    meta = build_sampling_metadata(virtual, eos_token_ids, device)
    meta.grammar = grammar
    raw = torch.log_softmax(logits.float(), dim=-1) if meta.max_num_logprobs is not None else None
    processed = process_logits(logits, meta)
    argmax = None if meta.all_random else processed.argmax(dim=-1).tolist()
    probs = None if meta.all_greedy else sampling_probs(processed, meta)
    rows, pos = [], 0
    for state, draft in zip(states, drafts):
        if state.sampling_params.is_greedy:
            accepted, token = _greedy(argmax[pos:pos + len(draft) + 1], draft)
        else:
            accepted, token = _rejection(probs[pos:pos + len(draft) + 1], draft,
                                         [meta.generators.get(pos + j) for j in range(len(draft) + 1)])
        wanted = state.sampling_params.logprobs
        entries = None
        if raw is not None and wanted is not None:
            entries = [_entry(raw[pos + j], t, wanted) for j, t in enumerate([*accepted, token])]
        rows.append(VerifiedRow(accepted, token, entries))
        pos += len(draft) + 1
    return rows


def _greedy(argmax: list[int], draft: list[int]) -> tuple[list[int], int]:
    m = 0
    while m < len(draft) and argmax[m] == draft[m]:
        m += 1
    return draft[:m], argmax[m]


def _rejection(probs: torch.Tensor, draft: list[int],
               generators: list[torch.Generator | None]) -> tuple[list[int], int]:
    """Sample each position as a one-token step would (a seeded request with that output position's generator),
    then accept the drafts while they equal the samples, and emit the sample where they stop. For a one-hot
    draft d that is Leviathan et al.'s rule: d is accepted with probability p(d), and on rejection the sample
    is drawn from p without d, norm(max(0, p - q)). A seeded request thus gets the very tokens it gets without
    drafts, however many drafts the engine chose to verify (core/spec_decode/cost_model.py times them)."""
    n = len(draft) + 1
    seeded = {j: gen for j, gen in enumerate(generators[:n]) if gen is not None}
    samples = exponential_race(probs[:n], seeded).tolist()
    m = 0
    while m < len(draft) and samples[m] == draft[m]:
        m += 1
    return draft[:m], samples[m]


def _entry(raw: torch.Tensor, token: int, k: int) -> LogprobsEntry:
    """As the sampler reports a sampled token: its raw logprob and rank, then the raw top-k."""
    chosen = raw[token]
    top_lps, top_ids = raw.topk(k) if k > 0 else (raw[:0], raw[:0].long())
    return LogprobsEntry(token_ids=[token, *top_ids.tolist()], logprobs=[float(chosen), *top_lps.tolist()],
                         sampled_rank=int((raw > chosen).sum()) + 1)
