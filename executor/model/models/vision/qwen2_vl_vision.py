"""Qwen2-VL's vision transformer (Qwen2VisionTransformerPretrainedModel): images and videos at their own
resolution, as rows of flattened patches (the processor's pixel_values [patches, C * T * p * p]) with their
grid [t, h, w]. The patch embedding is a Conv3d whose kernel equals its stride, i.e. one linear map of each
flattened patch; a 2-D rotary (height, width) in each head; pre-LN blocks whose full attention stays inside
one frame of one item (cu_seqlens as transformers builds them); and the merger, which concatenates each
merge x merge block of patches (the processor lays them out block by block) into one row of the language
model's width.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.model.layers.activation import get_activation

Grid = list[tuple[int, int, int]]


def vision_theta(cfg: Any) -> float:
    params = getattr(cfg, "rope_parameters", None) or {}
    return float(params.get("rope_theta", getattr(cfg, "rope_theta", 10000.0)))


def rotary_cos_sin(grid: Grid, merge: int, head_dim: int, theta: float,
                   device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Each patch's (cos, sin) [patches, head_dim] in float32: the first half of a head rotates by the
    patch's row, the second by its column, patches in the processor's block-by-block order, frames repeated."""
    spatial = head_dim // 2         # each axis's share of a head
    inv_freq = 1.0 / (theta ** (torch.arange(0, spatial, 2, dtype=torch.float, device=device) / spatial))
    rows, cols = [], []
    for t, h, w in grid:
        hh, ww = torch.meshgrid(torch.arange(h, device=device), torch.arange(w, device=device), indexing="ij")
        blocks = (h // merge, merge, w // merge, merge)
        rows.append(hh.reshape(blocks).transpose(1, 2).flatten().repeat(t))
        cols.append(ww.reshape(blocks).transpose(1, 2).flatten().repeat(t))
    freqs_h = torch.cat(rows)[:, None].float() * inv_freq
    freqs_w = torch.cat(cols)[:, None].float() * inv_freq
    half = torch.cat([freqs_h, freqs_w], dim=-1)
    emb = torch.cat([half, half], dim=-1)
    return emb.cos(), emb.sin()


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


def apply_vision_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [patches, heads, head_dim], rotated in float32 as transformers rotates it."""
    xf = x.float()
    return (xf * cos[:, None] + _rotate_half(xf) * sin[:, None]).to(x.dtype)


def segment_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seglens: list[int]) -> torch.Tensor:
    """Bidirectional attention within consecutive segments of patches: q, k, v [patches, heads, head_dim] ->
    [patches, heads * head_dim]. Equal segments (same-sized images, frames of a video) go in one call."""
    total, heads, dim = q.shape
    if len(set(seglens)) == 1:
        n, length = len(seglens), seglens[0]
        qs, ks, vs = (x.view(n, length, heads, dim).transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(qs, ks, vs)
        return out.transpose(1, 2).reshape(total, heads * dim)
    outs = []
    for qs, ks, vs in zip(*(x.split(seglens) for x in (q, k, v))):
        out = F.scaled_dot_product_attention(*(x.transpose(0, 1)[None] for x in (qs, ks, vs)))
        outs.append(out[0].transpose(0, 1).reshape(len(qs), heads * dim))
    return torch.cat(outs)


def frame_seglens(grid: Grid) -> list[int]:
    """Attention segments: each frame (temporal patch) of each item, h * w patches."""
    return [h * w for t, h, w in grid for _ in range(t)]


class PatchEmbed(nn.Module):
    def __init__(self, cfg: Any, embed_dim: int) -> None:
        super().__init__()
        self.patch_dim = cfg.in_channels * cfg.temporal_patch_size * cfg.patch_size ** 2
        kernel = (cfg.temporal_patch_size, cfg.patch_size, cfg.patch_size)
        # the checkpoint's Conv3d weight; its kernel equals its stride, so it is applied as a linear map
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(embed_dim, cfg.in_channels, *kernel))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.proj.weight
        return F.linear(pixel_values.to(weight.dtype), weight.reshape(len(weight), -1))


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.proj = nn.Linear(dim, dim)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seglens: list[int]) -> torch.Tensor:
        q, k, v = self.qkv(h).view(len(h), 3, self.num_heads, -1).unbind(1)
        q, k = apply_vision_rope(q, *rope), apply_vision_rope(k, *rope)
        return self.proj(segment_attention(q, k, v, seglens))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)
        self.act = get_activation(act, "vision_config.hidden_act")

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class Qwen2VLVisionBlock(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        dim = cfg.embed_dim
        self.norm1, self.norm2 = nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6)
        self.attn = VisionAttention(dim, cfg.num_heads)
        self.mlp = VisionMlp(dim, int(dim * cfg.mlp_ratio), cfg.hidden_act)

    def forward(self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], seglens: list[int]) -> torch.Tensor:
        h = h + self.attn(self.norm1(h), rope, seglens)
        return h + self.mlp(self.norm2(h))


class PatchMerger(nn.Module):
    """merge x merge neighbouring patches -> one row of the language model's width (LayerNorm, GELU MLP)."""

    def __init__(self, out_dim: int, context_dim: int, merge: int, norm: nn.Module | None = None) -> None:
        super().__init__()
        self.hidden = context_dim * merge ** 2
        self.ln_q = norm if norm is not None else nn.LayerNorm(context_dim, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out_dim))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(h).view(-1, self.hidden))


class Qwen2VLVisionTransformer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.merge = int(cfg.spatial_merge_size)
        self.head_dim = cfg.embed_dim // cfg.num_heads
        self.theta = vision_theta(cfg)
        self.patch_embed = PatchEmbed(cfg, cfg.embed_dim)
        self.blocks = nn.ModuleList(Qwen2VLVisionBlock(cfg) for _ in range(cfg.depth))
        self.merger = PatchMerger(cfg.hidden_size, cfg.embed_dim, self.merge)

    @property
    def patch_dim(self) -> int:
        return self.patch_embed.patch_dim

    def forward(self, pixel_values: torch.Tensor, grid: Grid) -> torch.Tensor:
        """pixel_values [patches, patch_dim] of the items of `grid`, in order -> merged rows
        [patches / merge^2, out hidden]."""
        h = self.patch_embed(pixel_values)
        rope = rotary_cos_sin(grid, self.merge, self.head_dim, self.theta, h.device)
        seglens = frame_seglens(grid)
        for block in self.blocks:
            h = block(h, rope, seglens)
        return self.merger(h)
