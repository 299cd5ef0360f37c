"""The workers' side of multimodal inputs: encoder outputs by content hash, and their rows in a step.

The core's EncoderCacheManager decides what is computed and what is dropped; a worker only follows, so every
rank holds the same entries. An item's output is computed once, in the step that first reaches it, outside
the per-token path; each step then copies the rows its chunks cover over the placeholder tokens' embeddings.
"""
from __future__ import annotations

from typing import Any

import torch

from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.step_buffers import HostBatch
from pagedserve.ipc.messages import EncoderInput, SchedulerOutput, TensorData


def to_tensor(data: TensorData, device: torch.device) -> torch.Tensor:
    dtype = getattr(torch, data.dtype)
    flat = torch.frombuffer(bytearray(data.data), dtype=dtype) if data.data else torch.empty(0, dtype=dtype)
    return flat.view(data.shape).to(device)


class EncoderRunner:
    def __init__(self, model: Any, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.cache: dict[str, torch.Tensor] = {}      # mm hash -> [placeholder tokens, hidden]

    def run(self, sched: SchedulerOutput) -> None:
        """Drop what the core evicted, then encode this step's new items (same-shaped ones in one call)."""
        for mm_hash in sched.free_encoder_mm_hashes:
            self.cache.pop(mm_hash, None)
        groups: dict[tuple, list[EncoderInput]] = {}
        for item in sched.encoder_inputs:
            key = (item.modality, tuple(sorted((k, v.dtype, tuple(v.shape)) for k, v in item.data.items())))
            groups.setdefault(key, []).append(item)
        for items in groups.values():
            batch = {name: torch.cat([to_tensor(i.data[name], self.device) for i in items])
                     for name in items[0].data}
            for item, out in zip(items, self.model.embed_multimodal(**batch)):
                self.cache[item.mm_hash] = out

    def gather(self, host: HostBatch,
               states: dict[str, CachedRequestState]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(token rows of the step, their encoder embeddings) for the placeholder tokens the step runs, or
        None when it runs none."""
        rows: list[torch.Tensor] = []
        values: list[torch.Tensor] = []
        for i, rid in enumerate(host.req_ids):
            items = states[rid].mm_features
            if not items:
                continue
            lo = int(host.query_start_loc[i])
            end = int(host.seq_lens[i])
            start = end - (int(host.query_start_loc[i + 1]) - lo)
            for item in items:
                a, b = max(item.offset, start), min(item.offset + item.length, end)
                if a >= b:
                    continue
                rows.append(torch.arange(lo + a - start, lo + b - start))
                values.append(self.cache[item.mm_hash][a - item.offset:b - item.offset])
        if not rows:
            return None
        return torch.cat(rows).to(self.device), torch.cat(values)
