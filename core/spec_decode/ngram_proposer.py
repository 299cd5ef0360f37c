"""Prompt lookup (vLLM's `ngram` method): draft the tokens that followed the last earlier occurrence of the
sequence's own suffix.

Pure host work on token ids, so it runs in the engine core beside the scheduler: the drafts go to the
workers with the step that verifies them, and nothing flows back up but the accepted tokens.
"""
from __future__ import annotations

import numpy as np


def propose_ngram(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k draft tokens: for n from max_n down to min_n, the suffix of length n is looked up in the
    earlier tokens; at the latest match, the tokens after it (at most k) are the draft. [] when none match."""
    length = len(token_ids)
    if k < 1 or length < min_n + 1:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        suffix = tokens[length - n:]
        # Windows starting at 0 .. length - n - 1: every occurrence that ends before the suffix itself.
        windows = np.lib.stride_tricks.sliding_window_view(tokens[:length - 1], n)
        hits = np.flatnonzero((windows == suffix).all(axis=1))
        if hits.size:
            start = int(hits[-1]) + n
            return token_ids[start:start + k]
    return []
