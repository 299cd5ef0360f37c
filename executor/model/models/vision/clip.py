"""The CLIP vision tower (CLIPVisionModel) as multimodal models use it: the hidden states of chosen encoder
layers, not CLIP's pooled output. Plain torch layers, bidirectional attention within each image."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.model.layers.activation import get_activation


def hidden_state_indices(feature_layer: int | Sequence[int], num_layers: int) -> list[int]:
    """Llava's vision_feature_layer (an int or a list of them, negative from the end) as indices into the
    tower's hidden states, 0 being the embeddings and i the output of encoder layer i - 1 (as HF counts)."""
    layers = [feature_layer] if isinstance(feature_layer, int) else list(feature_layer)
    if not layers:
        raise ValueError("vision_feature_layer: empty list")
    resolved = []
    for layer in layers:
        if not isinstance(layer, int) or not -(num_layers + 1) <= layer <= num_layers:
            raise ValueError(f"vision_feature_layer: {layer!r} is not a hidden state of a {num_layers}-layer "
                             f"vision tower (valid: {-(num_layers + 1)}..{num_layers})")
        resolved.append(layer % (num_layers + 1))
    return resolved


class CLIPVisionEmbeddings(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.image_size, self.patch_size = cfg.image_size, cfg.patch_size
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, kernel_size=cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)
        num_positions = (cfg.image_size // cfg.patch_size) ** 2 + 1      # the patches and the class token
        self.position_embedding = nn.Embedding(num_positions, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, channels, image_size, image_size] -> [n, 1 + patches, hidden]."""
        n, _, height, width = pixel_values.shape
        if height != self.image_size or width != self.image_size:
            raise ValueError(f"pixel_values: images of {height}x{width} pixels, the vision tower takes "
                             f"{self.image_size}x{self.image_size}")
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)
        cls = self.class_embedding.expand(n, 1, -1)
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class CLIPAttention(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.head_dim = hidden // self.num_heads
        self.q_proj, self.k_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)
        self.v_proj, self.out_proj = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        """h [n, tokens, hidden]: each image's tokens attend to all of that image's, none of another's;
        key_mask [n, tokens] (bool, True: attended) leaves out an image's padding (Idefics3's padded patches)."""
        n, tokens, _ = h.shape

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(n, tokens, self.num_heads, self.head_dim).transpose(1, 2)
        mask = None if key_mask is None else key_mask[:, None, None, :]
        out = F.scaled_dot_product_attention(heads(self.q_proj(h)), heads(self.k_proj(h)), heads(self.v_proj(h)),
                                             attn_mask=mask, scale=self.head_dim ** -0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, tokens, -1))


class CLIPMLP(nn.Module):
    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = get_activation(cfg.hidden_act, "vision_config.hidden_act")
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(h)))


class CLIPEncoderLayer(nn.Module):
    """Pre-LN: x += attn(LN(x)); x += mlp(LN(x))."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.self_attn = CLIPAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = CLIPMLP(cfg)

    def forward(self, h: torch.Tensor, key_mask: torch.Tensor | None = None) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h), key_mask)
        return h + self.mlp(self.layer_norm2(h))


class CLIPEncoder(nn.Module):
    def __init__(self, cfg: Any, num_layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(CLIPEncoderLayer(cfg) for _ in range(num_layers))


class CLIPVisionTower(nn.Module):
    """Returns the hidden states at `feature_layers` (hidden_state_indices). Only the encoder layers up to the
    deepest one asked for are built; post_layernorm normalises CLIP's pooled class token alone, which these
    hidden states never pass through, so it is not built either (the loader skips those tensors)."""

    def __init__(self, cfg: Any, feature_layers: Sequence[int]) -> None:
        super().__init__()
        if getattr(cfg, "model_type", "clip_vision_model") != "clip_vision_model":
            raise ValueError(f"vision_config.model_type: {cfg.model_type!r} is not supported (supported: "
                             "clip_vision_model)")
        self.feature_layers = list(feature_layers)
        self.embeddings = CLIPVisionEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)    # sic: HF's spelling
        self.encoder = CLIPEncoder(cfg, max(self.feature_layers))

    @property
    def num_layers(self) -> int:
        return len(self.encoder.layers)

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [n, channels, H, W] -> one [n, 1 + patches, hidden] per feature layer, in their order."""
        h = self.pre_layrnorm(self.embeddings(pixel_values))
        kept = {0: h}
        for i, layer in enumerate(self.encoder.layers, start=1):
            h = layer(h)
            if i in self.feature_layers:        # a deep tower's other states are dropped as it goes
                kept[i] = h
        return [kept[i] for i in self.feature_layers]
