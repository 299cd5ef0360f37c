"""M-RoPE positions in the workers (Qwen2-VL): computed once per request, when it is added, from the grids
its placements carry; each step then reads its rows' positions from them.

A text token, and every token after the prompt, has one position in all three rows (M-RoPE there is the
plain rotary), so every step keeps the 1-D positions, shifted to the rotary's (a token at index i after the
prompt sits at i + delta). Only a step whose rows cover vision tokens passes the model [3, T] positions; it
runs the layers (no CUDA graph, no C decode step), as every step that embeds an item does. Slot mappings and
attention lengths are built from the token indices before the shift, so the KV cache is unaffected.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class MRopeRows:
    """A request's M-RoPE positions: its prompt's [3, prompt_len], and the shift of every later token."""
    positions: np.ndarray
    delta: int
    vision: np.ndarray          # bool [prompt_len]: the prompt's vision placeholder tokens

    @classmethod
    def of(cls, model: Any, prompt_len: int, features: list) -> MRopeRows | None:
        """None for a request without vision items (its positions are the plain ones)."""
        if not features:
            return None
        positions, delta = model.mrope_positions(prompt_len, features)
        vision = np.zeros(prompt_len, dtype=bool)
        for item in features:
            vision[item.offset:item.offset + item.length] = True
        return cls(positions, delta, vision)


def rope_positions(positions: np.ndarray, query_start_loc: np.ndarray,
                   rows: list[MRopeRows | None]) -> np.ndarray | None:
    """Shift a step's positions (token indices, a HostBatch's) to the rotary's, in place, for the rows of
    requests with M-RoPE (rows: per batch row, in the batch's order). Returns the step's [3, T] positions
    when a row covers vision tokens, else None (the 1-D positions are then exact)."""
    spans: list[tuple[int, int, np.ndarray]] = []
    for i, mrope in enumerate(rows):
        if mrope is None:
            continue
        lo, hi = int(query_start_loc[i]), int(query_start_loc[i + 1])
        index = positions[lo:hi]
        prompt_len = len(mrope.vision)
        in_prompt = index < prompt_len
        inside = index[in_prompt]
        if mrope.vision[inside].any():
            three = np.repeat((index + mrope.delta)[None], 3, axis=0)
            three[:, in_prompt] = mrope.positions[:, inside]
            spans.append((lo, hi, three))
        shifted = index + mrope.delta
        shifted[in_prompt] = mrope.positions[0, inside]
        positions[lo:hi] = shifted
    if not spans:
        return None
    out = np.repeat(positions[None], 3, axis=0)
    for lo, hi, three in spans:
        out[:, lo:hi] = three
    return out
