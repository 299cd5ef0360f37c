"""How far each token of a step may look, for a model that attends both ways among one item's tokens (Gemma 3:
HF's token_type_ids mask, families.BIDIRECTIONAL_FAMILIES).

HF's mask is OR(causal, same image) on global layers and AND(window, OR(causal, same image)) on sliding ones.
Both come to one number per query token: the last key position it sees. A text token sees up to itself; a
token of an item sees up to its item's last token (the window, where a layer has one, still bounds the keys
from below). So the attention backends take one extra [T] vector (AttentionMetadata.visible_until) and no
mask of item ids. The core runs every item whole in one chunk (core/multimodal/encoder_scheduler.py), so the
item's last token is always inside the step's context.
"""
from __future__ import annotations

import numpy as np

from pagedserve.executor.worker.request_state import CachedRequestState
from pagedserve.executor.worker.step_buffers import HostBatch


def visible_until(host: HostBatch, states: dict[str, CachedRequestState]) -> np.ndarray | None:
    """[T] int64, each token's last visible key position (its own for text tokens); None when no token of the
    step lies inside an item (then attention is plain causal and the backends keep their fast paths)."""
    bounds: np.ndarray | None = None
    for i, rid in enumerate(host.req_ids):
        items = states[rid].mm_features
        if not items:
            continue
        lo, hi = int(host.query_start_loc[i]), int(host.query_start_loc[i + 1])
        start, end = int(host.seq_lens[i]) - (hi - lo), int(host.seq_lens[i])
        for item in items:
            a, b = max(item.offset, start), min(item.offset + item.length, end)
            if a >= b:
                continue
            if bounds is None:
                bounds = host.positions.astype(np.int64, copy=True)
            bounds[lo + a - start:lo + b - start] = item.offset + item.length - 1
    return bounds
