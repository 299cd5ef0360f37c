"""Speculative method draft_model: a smaller model with the same vocabulary proposes each request's next k
tokens, greedily, in the worker beside the model it drafts for.

Its KV cache is its own tensors indexed by the same block tables and slots as the model's (the scheduler holds
k lookahead slots per request for the proposals), so preemption, prefix hits and freed blocks need nothing of
their own: every step the draft runs the step's tokens too (prefill chunks, verified drafts), writing its cache
where the model wrote its own, then one-token passes from each request's newest token, as many as the core
asked for it (SchedulerOutput.num_draft_tokens_to_propose: what its next plan can verify; none asked, no pass).
Greedy drafts are one-hot, which is what the rejection sampler takes.

A draft with a whole-decoder step of its own (the C decode step of a weight-only quantized CPU Llama, e.g. a GGUF
drafting for itself or for a bigger GGUF of its tokenizer) runs its one-token passes and short catch-up passes
there, as the model runner runs the model's: built once the draft's cache is bound (`build_decode_step`), it
takes the passes it can and the draft's PyTorch layers run the rest.
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import nn

from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.step_buffers import HostBatch, PreparedBatch, StepBuffers
from pagedserve.kernels.attention.metadata import AttentionMetadata


class DraftModelProposer:
    def __init__(self, model: nn.Module, num_speculative_tokens: int, max_model_len: int, block_size: int) -> None:
        self.model = model
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        # (input_ids, positions, meta) -> final-normed hidden states, or None for a pass it does not take.
        self.decode_step: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor | None] | None = None

    def build_decode_step(self) -> None:
        """The draft's own whole-decoder step over its bound cache (the model's make_decode_step), if it has one."""
        make_step = getattr(self.model, "make_decode_step", None)
        self.decode_step = make_step() if make_step is not None else None

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        if self.decode_step is not None:
            hidden = self.decode_step(input_ids, positions, meta)
            if hidden is not None:
                return hidden
        return self.model(input_ids, positions, meta)

    def propose(self, batch: PreparedBatch, hidden: torch.Tensor, states: dict[str, CachedRequestState],
                rows: list[int], lengths: list[int], buffers: StepBuffers) -> list[list[int]]:
        """Drafts of lengths[i] tokens for rows[i] (rows that sampled this step: their states already hold the
        sampled tokens), after running the step's own tokens through the draft (always: its cache must hold
        every token); max(lengths) one-token passes, each over the rows still short of their length.
        `hidden` (the model's) is not read: a draft model has its own."""
        self._forward(batch.input_ids, batch.positions, batch.meta)
        if not rows:
            return []
        rids = [batch.req_ids[r] for r in rows]
        tokens = [states[rid].token_ids[-1] for rid in rids]
        positions = [len(states[rid].token_ids) - 1 for rid in rids]
        drafts: list[list[int]] = [[] for _ in rids]
        for step in range(max(lengths)):
            live = [i for i, p in enumerate(positions) if p < self.max_model_len and step < lengths[i]]
            if not live:
                break
            host = one_token_batch([states[rids[i]] for i in live], [tokens[i] for i in live],
                                    [positions[i] for i in live], [rids[i] for i in live], self.block_size)
            step_batch = buffers.commit(host)
            hidden = self._forward(step_batch.input_ids, step_batch.positions, step_batch.meta)
            proposed = self.model.compute_logits(hidden).argmax(dim=-1).tolist()
            for i, token in zip(live, proposed):
                drafts[i].append(token)
                tokens[i] = token
                positions[i] += 1
        return drafts


def one_token_batch(states: list[CachedRequestState], tokens: list[int], positions: list[int],
                     rids: list[str], block_size: int) -> HostBatch:
    """A decode step of one token per request at the given positions (its slot in the request's blocks)."""
    n = len(states)
    pos = np.asarray(positions, dtype=np.int64)
    width = max(len(s.block_ids) for s in states)
    tables = np.zeros((n, width), dtype=np.int64)
    for i, s in enumerate(states):
        tables[i, :len(s.block_ids)] = s.block_ids
    slots = tables[np.arange(n), pos // block_size] * block_size + pos % block_size
    return HostBatch(req_ids=rids, input_ids=np.asarray(tokens, dtype=np.int64), positions=pos, slot_mapping=slots,
                     query_start_loc=np.arange(n + 1, dtype=np.int64), seq_lens=pos + 1, block_tables=tables,
                     logits_indices=np.arange(n, dtype=np.int64), sample_rows=list(range(n)), num_decodes=n)


def bind_draft_cache(model: nn.Module, caches: list[torch.Tensor], backend) -> None:
    """The draft's attention layers read and write their own cache tensors."""
    for layer, cache in zip(model.attention_layers(), caches):
        layer.bind_kv_cache(cache, backend)
