"""Flatten one step of a ragged batch into the model's inputs (ids, positions, slots, block tables)."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve.executor.request_state import CachedRequestState
from pagedserve.kernels.metadata import AttentionMetadata


@dataclass
class PreparedBatch:
    req_ids: list[str]                 # row order of the batch: decodes first
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor       # token index whose hidden state feeds each sampled row
    sample_rows: list[int]             # batch rows that sample this step (caught up with their tokens)


def order_rows(states: dict[str, CachedRequestState], num_scheduled: dict[str, int]) -> list[str]:
    """Decodes (one new token) first, as the attention op expects, sorted by context length so that
    neighbours have similar lengths (less padding when attention works on groups of them)."""
    decodes = sorted((rid for rid, n in num_scheduled.items() if n == 1),
                     key=lambda rid: states[rid].num_computed_tokens)
    others = [rid for rid, n in num_scheduled.items() if n != 1]
    return decodes + others


def prepare_inputs(states: dict[str, CachedRequestState], num_scheduled: dict[str, int],
                   block_size: int, device: torch.device) -> PreparedBatch:
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
    for i, rid in enumerate(req_ids):
        state = states[rid]
        block_tables[i, :len(state.block_ids)] = state.block_ids
        lo, hi = int(query_start[i]), int(query_start[i + 1])
        input_ids[lo:hi] = state.token_ids[int(starts[i]):int(seq_lens[i])]
        if seq_lens[i] >= len(state.token_ids):
            sample_rows.append(i)
    slot_mapping = block_tables[row_of_token, positions // block_size] * block_size + positions % block_size
    logits_indices = query_start[1:][sample_rows] - 1

    num_decodes = int(np.count_nonzero(counts == 1)) if num_seqs else 0
    # order_rows put all single-token rows first, so they form a prefix.
    meta = AttentionMetadata(
        slot_mapping=_to(slot_mapping, device), query_start_loc=_to(query_start, device, torch.int32),
        seq_lens=_to(seq_lens, device, torch.int32), block_tables=_to(block_tables, device, torch.int32),
        num_decodes=num_decodes, max_query_len=int(counts.max()), max_seq_len=int(seq_lens.max()),
        query_start_loc_cpu=query_start.tolist(), seq_lens_cpu=seq_lens.tolist())
    return PreparedBatch(req_ids=req_ids, input_ids=_to(input_ids, device), positions=_to(positions, device),
                         meta=meta, logits_indices=_to(logits_indices, device), sample_rows=sample_rows)


def _to(array: np.ndarray, device: torch.device, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    tensor = torch.from_numpy(np.ascontiguousarray(array)).to(dtype)
    return tensor if device.type == "cpu" else tensor.to(device, non_blocking=True)
