"""Measure the activation memory of the largest steps, to size the GPU KV cache from what is left."""
from __future__ import annotations

import numpy as np
import torch

from pagedserve.executor.worker.sample.sampling_metadata import SamplingMetadata
from pagedserve.executor.worker.step_buffers import HostBatch


def dummy_prefill_batch(num_tokens: int, num_seqs: int, max_model_len: int, block_size: int) -> HostBatch:
    """num_tokens prompt tokens over num_seqs fresh sequences; every slot is -1, so nothing is written."""
    num_seqs = max(min(num_seqs, num_tokens), -(-num_tokens // max_model_len))
    counts = np.full(num_seqs, num_tokens // num_seqs, dtype=np.int64)
    counts[: num_tokens % num_seqs] += 1
    query_start = np.zeros(num_seqs + 1, dtype=np.int64)
    np.cumsum(counts, out=query_start[1:])
    positions = np.arange(num_tokens, dtype=np.int64) - np.repeat(query_start[:-1], counts)
    width = -(-int(counts.max()) // block_size)
    return HostBatch(
        req_ids=[f"profile-{i}" for i in range(num_seqs)], input_ids=np.zeros(num_tokens, dtype=np.int64),
        positions=positions, slot_mapping=np.full(num_tokens, -1, dtype=np.int64), query_start_loc=query_start,
        seq_lens=counts.copy(), block_tables=np.zeros((num_seqs, width), dtype=np.int64),
        logits_indices=query_start[1:] - 1, sample_rows=list(range(num_seqs)),
        num_decodes=int(np.count_nonzero(counts == 1)))


def random_sampling_metadata(num_rows: int, device: torch.device) -> SamplingMetadata:
    """The sampler's most memory-hungry path: temperature with top-k and top-p (full-vocab sorts)."""
    return SamplingMetadata(
        temperature=torch.ones(num_rows, device=device), all_greedy=False, all_random=True,
        top_p=torch.full((num_rows,), 0.9, device=device),
        top_k=torch.full((num_rows,), 50, dtype=torch.int64, device=device))


def peak_step_bytes(runner, batch: HostBatch) -> int:
    """Peak bytes allocated above the current level while running batch forward + logits + sampling."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.inference_mode():
        prepared = runner.buffers.commit(batch)
        hidden = runner.model(prepared.input_ids, prepared.positions, prepared.meta)
        if hasattr(runner.model, "compute_logits"):      # a pooling encoder has no LM head
            logits = runner.model.compute_logits(hidden[prepared.logits_indices])
            runner.sampler(logits, random_sampling_metadata(logits.shape[0], logits.device))
            del logits
        del hidden
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base
