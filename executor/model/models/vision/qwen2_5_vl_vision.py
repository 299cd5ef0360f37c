"""Qwen2.5-VL's vision transformer (Qwen2_5_VisionTransformerPretrainedModel): Qwen2-VL's patch embedding,
2-D rotary and patch merger (its norm an RMSNorm), with RMSNorm blocks whose MLP is gated (SiLU), and window
attention: the merged cells of each frame are grouped into windows of window_size pixels a side, the patches
reordered window by window, and every block but those of fullatt_block_indexes attends within a window only
(the others within a frame). The merger's rows are put back in the processor's order at the end.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.layers.activation import get_activation
from pagedserve.executor.model.models.vision.qwen2_vl_vision import (Grid, PatchEmbed, PatchMerger, VisionAttention,
                                                                      frame_seglens, rotary_cos_sin, vision_theta)


class VisionRMSNorm(nn.Module):
    """transformers' Qwen2_5_VLRMSNorm: the mean square in float32, the weight applied in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return self.weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


class GatedMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, hidden), nn.Linear(dim, hidden)
        self.down_proj = nn.Linear(hidden, dim)
        self.act = get_activation(act, "vision_config.hidden_act")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_proj(h)) * self.up_proj(h))


class Qwen2_5_VLVisionBlock(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim = cfg.hidden_size
        self.norm1, self.norm2 = VisionRMSNorm(dim), VisionRMSNorm(dim)
        self.attn = VisionAttention(dim, cfg.num_heads)
        self.mlp = GatedMlp(dim, cfg.intermediate_size, cfg.hidden_act)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seglens: list[int]) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), rope, seglens)
        return h + self.mlp(self.norm2(h))


def window_order(grid: Grid, merge: int, cells: int) -> tuple[torch.Tensor, list[int]]:
    """(the merged cells reordered window by window, each window's patch count): per frame, windows of
    `cells` x `cells` merged cells from the top left, the last row and column of windows cut by the grid's
    edge, as transformers' get_vision_window_index groups them (its empty windows dropped)."""
    order: list[torch.Tensor] = []
    seglens: list[int] = []
    base = 0
    for t, h, w in grid:
        gh, gw = h // merge, w // merge
        index = torch.arange(t * gh * gw).view(t, gh, gw)
        for frame in range(t):
            for r in range(0, gh, cells):
                for c in range(0, gw, cells):
                    window = index[frame, r:r + cells, c:c + cells].reshape(-1)
                    order.append(window + base)
                    seglens.append(len(window) * merge * merge)
        base += t * gh * gw
    return torch.cat(order), seglens


class Qwen2_5_VLVisionTransformer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.merge = int(cfg.spatial_merge_size)
        self.unit = self.merge ** 2
        self.head_dim = cfg.hidden_size // cfg.num_heads
        self.theta = vision_theta(cfg)
        self.window_cells = cfg.window_size // self.merge // cfg.patch_size
        self.full_blocks = set(cfg.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(cfg, cfg.hidden_size)
        self.blocks = nn.ModuleList(Qwen2_5_VLVisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.out_hidden_size, cfg.hidden_size, self.merge, VisionRMSNorm(cfg.hidden_size))

    @property
    def patch_dim(self) -> int:
        return self.patch_embed.patch_dim

    def _windowed(self, x: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
        """Rows of patches reordered by merged cell (each cell's merge^2 patches stay together)."""
        return x.view(-1, self.unit, *x.shape[1:])[order].reshape(x.shape)

    def forward(self, pixel_values: torch.Tensor, grid: Grid) -> torch.Tensor:
        """pixel_values [patches, patch_dim] of the items of `grid` -> merged rows [patches / merge^2, out]."""
        h = self.patch_embed(pixel_values)
        order, window_lens = window_order(grid, self.merge, self.window_cells)
        order = order.to(h.device)
        h = self._windowed(h, order)
        cos, sin = rotary_cos_sin(grid, self.merge, self.head_dim, self.theta, h.device)
        rope = (self._windowed(cos, order), self._windowed(sin, order))
        frames = frame_seglens(grid)
        for i, block in enumerate(self.blocks):
            h = block(h, rope, frames if i in self.full_blocks else window_lens)
        merged = self.merger(h)
        return merged[torch.argsort(order)]
