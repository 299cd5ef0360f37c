"""Flatten one step of a ragged batch into the model's inputs (ids, positions, slots, block tables)."""
from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.step_buffers import HostBatch


def order_rows(states: dict[str, CachedRequestState], num_scheduled: dict[str, int]) -> list[str]:
    """Decodes (one new token) first, as the attention op expects, sorted by context length so that
    neighbours have similar lengths (less padding when attention works on groups of them)."""
    decodes = sorted((rid for rid, n in num_scheduled.items() if n == 1),
                     key=lambda rid: states[rid].num_computed_tokens)
    others = [rid for rid, n in num_scheduled.items() if n != 1]
    return decodes + others


def prepare_inputs(states: dict[str, CachedRequestState], num_scheduled: dict[str, int],
                   block_size: int, drafts: Mapping[str, list[int]] | None = None) -> HostBatch:
    """drafts: a request's draft tokens, run after its last real token (their ids are in no state yet).
    An input id still on the device (a state's pending one) is -1 here and listed in pending_inputs."""
    req_ids = order_rows(states, num_scheduled)
    num_seqs = len(req_ids)
    counts = np.fromiter((num_scheduled[r] for r in req_ids), dtype=np.int64, count=num_seqs)
    starts = np.fromiter((states[r].num_computed_tokens for r in req_ids), dtype=np.int64, count=num_seqs)
    query_start = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    seq_lens = starts + counts
    total = int(query_start[-1])

    # positions: for each row, start .. start+count-1, built without a Python loop over tokens.
    row_of_token = np.repeat(np.arange(num_seqs), counts)
    positions = np.arange(total, dtype=np.int64) - np.repeat(query_start[:-1] - starts, counts)

    max_blocks = max(len(states[r].block_ids) for r in req_ids)
    block_tables = np.zeros((num_seqs, max_blocks), dtype=np.int64)
    input_ids = np.empty(total, dtype=np.int64)
    sample_rows = []
    pending_inputs = []
    for i, rid in enumerate(req_ids):
        state = states[rid]
        block_tables[i, :len(state.block_ids)] = state.block_ids
        lo, hi = int(query_start[i]), int(query_start[i + 1])
        source = state.token_ids + drafts[rid] if drafts and rid in drafts else state.token_ids
        input_ids[lo:hi] = source[int(starts[i]):int(seq_lens[i])]
        for index, (step, k) in state.pending.items():
            if starts[i] <= index < seq_lens[i]:
                pending_inputs.append((lo + index - int(starts[i]), step, k))
        if seq_lens[i] >= len(state.token_ids):
            sample_rows.append(i)
    slot_mapping = block_tables[row_of_token, positions // block_size] * block_size + positions % block_size
    logits_indices = query_start[1:][sample_rows] - 1

    num_decodes = int(np.count_nonzero(counts == 1)) if num_seqs else 0
    # order_rows put all single-token rows first, so they form a prefix.
    return HostBatch(req_ids=req_ids, input_ids=input_ids, positions=positions, slot_mapping=slot_mapping,
                     query_start_loc=query_start, seq_lens=seq_lens, block_tables=block_tables,
                     logits_indices=logits_indices, sample_rows=sample_rows, num_decodes=num_decodes,
                     pending_inputs=pending_inputs)
