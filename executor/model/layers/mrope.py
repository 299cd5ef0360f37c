"""Multimodal rotary embedding (M-RoPE, Qwen2-VL): each token has three positions (temporal, height, width),
and the rotary's frequency pairs are split into three sections (`mrope_section`, summing to head_dim / 2),
section i rotated by position i.

Text tokens, and every decoded token, carry one position in all three rows, and then M-RoPE is the plain
1-D rotary at that position. So a model with M-RoPE takes positions [T] (the 1-D path: decode steps, the C
decode step and CUDA graphs stay as they are) or [3, T] (prefill rows over image tokens); the worker decides
which (executor/worker/multimodal/mrope.py).
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import nn

from pagedserve.executor.model.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(nn.Module):
    """The plain rotary's cos/sin tables, read per frequency from the position row of its section."""

    def __init__(self, rope: RotaryEmbedding, mrope_section: Sequence[int]) -> None:
        super().__init__()
        self.rope = rope
        self.head_dim = rope.head_dim
        section = [int(s) for s in mrope_section]
        if len(section) != 3 or any(s < 0 for s in section) or sum(section) * 2 != self.head_dim:
            raise ValueError(f"rope_parameters.mrope_section: {list(mrope_section)} must be three sizes summing to "
                             f"head_dim / 2 = {self.head_dim // 2}")
        half = [row for row, size in enumerate(section) for _ in range(size)]
        # cos/sin repeat the half-dim frequencies twice (rotate-half layout): so do the sections
        self.register_buffer("row_of_dim", torch.tensor(half + half), persistent=False)
        self.register_buffer("dims", torch.arange(self.head_dim), persistent=False)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [T] (one position a token) or [3, T] -> ([T, 1, D], [T, 1, D]) in dtype."""
        if positions.dim() == 1:
            return self.rope.cos_sin(positions, dtype)
        if positions.dim() != 2 or positions.shape[0] != 3:
            raise ValueError(f"positions: M-RoPE takes [T] or [3, T], got shape {tuple(positions.shape)}")
        per_dim = positions.index_select(0, self.row_of_dim).T            # [T, D]: each dim's position
        cos = self.rope.cos_cache[per_dim, self.dims].to(dtype)
        sin = self.rope.sin_cache[per_dim, self.dims].to(dtype)
        return cos.unsqueeze(1), sin.unsqueeze(1)


def mrope_positions(prompt_len: int, items: Sequence[tuple[int, int, tuple[int, int, int], float]],
                    spatial_merge_size: int) -> tuple[np.ndarray, int]:
    """A prompt's M-RoPE positions [3, prompt_len] and its delta (a later token at index i sits at i + delta),
    as transformers' Qwen2-VL get_rope_index counts them. items: each vision item's (offset, length, its grid
    (t, h, w) in patches, seconds between its temporal positions: 1 for Qwen2-VL and for any image), in
    prompt order. Text runs count on from where the item before left off; an item's tokens take their
    (t, h / merge, w / merge) cell from its first position, and the text after it starts max(h, w) / merge
    past that."""
    rows = np.empty((3, prompt_len), dtype=np.int64)
    current = done = 0
    for offset, length, (t, h, w), interval in items:
        text = offset - done
        rows[:, done:offset] = np.arange(current, current + text)
        current += text
        gh, gw = h // spatial_merge_size, w // spatial_merge_size
        if t * gh * gw != length:
            raise ValueError(f"mm_features: {length} placeholder tokens for a {t}x{h}x{w} grid merged by "
                             f"{spatial_merge_size}")
        # float32 as transformers scales the temporal index, truncated as its .long() truncates
        temporal = (np.arange(t, dtype=np.float32) * np.float32(interval)).astype(np.int64) + current
        cells = np.stack(np.meshgrid(temporal, np.arange(gh) + current, np.arange(gw) + current, indexing="ij"))
        rows[:, offset:offset + length] = cells.reshape(3, -1)
        current += max(gh, gw)
        done = offset + length
    rows[:, done:] = np.arange(current, current + prompt_len - done)
    delta = int(rows.max()) + 1 - prompt_len if prompt_len else 0
    return rows, delta
