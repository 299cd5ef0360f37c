"""Speculative methods eagle and eagle3: an EAGLE head proposes each request's next k tokens, greedily, from
the model's hidden states (executor/model/models/llama_eagle.py).

The head's position j reads token j+1 and the model's feature at j, so its KV cache (own tensors on the same
block tables and slots as the model's, like a draft model's) is written one token ahead. Every step the head
runs the step's positions with the next token of each (known once the step sampled; 0 past a rejected draft,
whose slots the next step rewrites), then drafts from the position before each row's newest token: its first
proposal from that pass, then one-token passes that feed the head's own output back as the feature, up to the
length the core asked for each row (SchedulerOutput.num_draft_tokens_to_propose).
"""
from __future__ import annotations

import numpy as np
import torch
from torch import nn

from pagedserve.executor.worker.spec_decode.draft_proposer import one_token_batch
from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.step_buffers import PreparedBatch, StepBuffers


class EagleProposer:
    def __init__(self, head: nn.Module, target: nn.Module, num_speculative_tokens: int, max_model_len: int,
                 block_size: int) -> None:
        head.share_target(target)
        self.model = head
        self.target = target
        self.aux_layers: tuple[int, ...] = getattr(head, "aux_layers", ())
        if self.aux_layers:
            target.model.aux_layers = self.aux_layers
        self.k = num_speculative_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size

    @property
    def needs_aux_hidden(self) -> bool:
        """EAGLE-3 reads the model's inner layers, which only the model's own forward keeps (not the CPU's
        one-call decode step, nor a CUDA graph's fixed outputs)."""
        return bool(self.aux_layers)

    def propose(self, batch: PreparedBatch, hidden: torch.Tensor, states: dict[str, CachedRequestState],
                rows: list[int], lengths: list[int], buffers: StepBuffers) -> list[list[int]]:
        """Drafts of lengths[i] tokens for rows[i] (rows that sampled this step), after the head ran the step's
        positions (always: its cache must hold them); the first from that pass, then max(lengths) - 1
        one-token passes over the rows still short of their length."""
        num_tokens = len(batch.input_ids)
        features = self.target.model.aux_hidden if self.aux_layers else hidden
        next_ids = torch.from_numpy(self._next_ids(batch, states, num_tokens)).to(batch.input_ids.device)
        out, carry = self.model(next_ids, batch.positions, batch.meta, features[:num_tokens])
        if not rows:
            return []
        rids = [batch.req_ids[r] for r in rows]
        sizes = [len(states[rid].token_ids) for rid in rids]
        starts, seq_lens = batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu
        # The row's position before its newest token, as an index into the step's tokens.
        index = [starts[r] + (n - 2) - (seq_lens[r] - (starts[r + 1] - starts[r])) for r, n in zip(rows, sizes)]
        index_t = torch.tensor(index, dtype=torch.int64, device=out.device)
        out, carry = out[index_t], carry[index_t]
        drafts: list[list[int]] = [[] for _ in rids]
        positions = [n - 1 for n in sizes]          # where each next proposal is read into the head
        live = list(range(len(rids)))
        while True:
            proposed = self.model.to_target_ids(self.model.compute_logits(out).argmax(dim=-1))
            tokens = proposed.tolist()
            for i, token in zip(live, tokens):
                drafts[i].append(token)
            keep = [j for j, i in enumerate(live)
                    if positions[i] < self.max_model_len and len(drafts[i]) < lengths[i]]
            if not keep:
                break
            live = [live[j] for j in keep]
            keep_t = torch.tensor(keep, dtype=torch.int64, device=out.device)
            host = one_token_batch([states[rids[i]] for i in live], [drafts[i][-1] for i in live],
                                   [positions[i] for i in live], [rids[i] for i in live], self.block_size)
            step_batch = buffers.commit(host)
            out, carry = self.model(step_batch.input_ids, step_batch.positions, step_batch.meta, carry[keep_t])
            for i in live:
                positions[i] += 1
        return drafts

    @staticmethod
    def _next_ids(batch: PreparedBatch, states: dict[str, CachedRequestState], num_tokens: int) -> np.ndarray:
        """Each of the step's positions' next token id (0 where none is known: padding, rejected drafts)."""
        ids = np.zeros(num_tokens, dtype=np.int64)
        starts, seq_lens = batch.meta.query_start_loc_cpu, batch.meta.seq_lens_cpu
        for row, rid in enumerate(batch.req_ids):
            lo, hi = starts[row], starts[row + 1]
            first = seq_lens[row] - (hi - lo) + 1
            known = states[rid].token_ids[first:first + hi - lo]
            ids[lo:lo + len(known)] = known
        return ids
