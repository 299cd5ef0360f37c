"""Idefics3's vision transformer (Idefics3VisionTransformer, SigLIP with NaViT-style position ids): patch
convolution, one learned position per cell of the full-size patch grid, pre-LN encoder layers with
bidirectional attention within each image, and a final LayerNorm. A padded image (its pixel_attention_mask
zero at the padding) keeps its position ids spread over the whole grid and attends to its real patches only.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.models.vision.clip import CLIPEncoderLayer


def _as_int(value: Any, field: str) -> int:
    """image_size and patch_size may be [h, w] in the config; the tower's grid is square."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision_config.{field}: non-square {list(value)} is not supported")
        value = value[0]
    return int(value)


def patch_mask(pixel_attention_mask: torch.Tensor, patch_size: int) -> torch.Tensor:
    """pixel_attention_mask [n, H, W] -> [n, H // p, W // p] bool: a patch is real when any of its pixels is
    (pixels past the last whole patch are cut, as the convolution cuts them)."""
    n, height, width = pixel_attention_mask.shape
    rows, cols = height // patch_size, width // patch_size
    cells = pixel_attention_mask[:, :rows * patch_size, :cols * patch_size]
    cells = cells.reshape(n, rows, patch_size, cols, patch_size)
    return cells.sum(dim=(2, 4)) > 0


class Idefics3VisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.patch_size = _as_int(cfg.patch_size, "patch_size")
        self.side = _as_int(cfg.image_size, "image_size") // self.patch_size    # the position grid's side
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=self.patch_size,
                                         stride=self.patch_size)
        self.position_embedding = nn.Embedding(self.side ** 2, cfg.hidden_size)

    def position_ids(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [n, rows, cols] bool -> [n, rows * cols] ids: each real patch's fraction of its image's real
        extent, bucketed into the `side` cells of each axis; padding takes id 0. The float steps are HF's own
        (float32 fractions against arange'd boundaries), so a boundary case falls in the same bucket."""
        n, rows, cols = patches.shape
        device = patches.device
        boundaries = torch.arange(1 / self.side, 1.0, 1 / self.side, device=device)

        def buckets(length: int, real: torch.Tensor) -> torch.Tensor:
            steps = torch.arange(length, device=device, dtype=torch.float32)[None, :] * (1.0 / real)[:, None]
            return torch.bucketize(steps.clamp(max=1.0 - 1e-6), boundaries, right=True)
        ids = buckets(rows, patches[:, :, 0].sum(dim=1))[:, :, None] * self.side \
            + buckets(cols, patches[:, 0, :].sum(dim=1))[:, None, :]
        return torch.where(patches.reshape(n, -1), ids.reshape(n, -1), torch.zeros_like(ids.reshape(n, -1)))

    def forward(self, pixel_values: torch.Tensor, patches: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, channels, H, W], patches [n, H // p, W // p] -> [n, patches, hidden]."""
        embeds = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        return embeds + self.position_embedding(self.position_ids(patches))


class Idefics3Encoder(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        # SigLIP's encoder layer is CLIP's (pre-LN attention then MLP, the same parameter names)
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class Idefics3VisionTransformer(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        if getattr(cfg, "model_type", "idefics3_vision") != "idefics3_vision":
            raise ValueError(f"vision_config.model_type: {cfg.model_type!r} is not supported (supported: "
                             "idefics3_vision)")
        self.embeddings = Idefics3VisionEmbeddings(cfg)
        self.encoder = Idefics3Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    @property
    def patch_size(self) -> int:
        return self.embeddings.patch_size

    def forward(self, pixel_values: torch.Tensor, pixel_attention_mask: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, channels, H, W], pixel_attention_mask [n, H, W] -> [n, patches, hidden]."""
        patches = patch_mask(pixel_attention_mask, self.patch_size)
        h = self.embeddings(pixel_values, patches)
        keys = patches.reshape(len(patches), -1)
        key_mask = None if bool(keys.all()) else keys       # no mask: SDPA's unmasked path for whole images
        for layer in self.encoder.layers:
            h = layer(h, key_mask)
        return self.post_layernorm(h)
