"""Qwen2-VL (Qwen2VLForConditionalGeneration): a dynamic-resolution vision transformer whose patch merger
writes rows of the language model's width, and a Qwen2 language model with M-RoPE (layers/mrope.py).

An image or a video is one item: `pixel_values` (or `pixel_values_videos`) [patches, C * T * p * p] and its
grid `image_grid_thw` (`video_grid_thw`) [[t, h, w]]; it takes t * h * w / merge^2 placeholder tokens. The
workers compute each request's M-RoPE positions once, when it is added (`mrope_positions`), from the grids
its placements carry.

Checkpoint names are canonicalised to the layout transformers 5's save_pretrained writes
(`model.language_model.*`, `model.visual.*`, `lm_head.*`); the hub's classic names (`model.*` for the
language model, `visual.*`) are renamed to it (_canonical).
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from pagedserve.common.multimodal.families import image_token_id
from pagedserve.executor.model.layers.mrope import MRotaryEmbedding, mrope_positions
from pagedserve.executor.model.models.llama import Qwen2ForCausalLM
from pagedserve.executor.model.models.vision.qwen2_vl_vision import Grid, Qwen2VLVisionTransformer
from pagedserve.executor.model.models.vision.vlm import SKIP, VisionLanguageModel, tied_text_config
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup
from pagedserve.ipc.messages import MultiModalFeature

_TEXT, _VISION = "model.language_model.", "model.visual."
# modality -> (its patches tensor, its grid tensor)
ITEM_TENSORS = {"image": ("pixel_values", "image_grid_thw"), "video": ("pixel_values_videos", "video_grid_thw")}
_DEFAULT_MROPE_SECTION = (16, 24, 24)        # transformers' default where the config names none


def _canonical(name: str) -> str:
    if name.startswith("visual."):
        return "model." + name
    if name.startswith("model.") and not name.startswith((_TEXT, _VISION)):
        return _TEXT + name[len("model."):]
    return name


def mrope_section(text_config: Any) -> Sequence[int]:
    params = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None) or {}
    return params.get("mrope_section") or _DEFAULT_MROPE_SECTION


class Qwen2VLLanguageModel(Qwen2ForCausalLM):
    """Qwen2 with M-RoPE: positions [T] or [3, T]."""

    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__(hf_config, tp, pp)
        self.model.rotary_emb = MRotaryEmbedding(self.model.rotary_emb, mrope_section(hf_config))


def feature_grid(feature: MultiModalFeature) -> tuple[int, int, int]:
    """The (t, h, w) an item's placement carries (the core checked it: int64 [1, 3])."""
    key = ITEM_TENSORS[feature.modality][1]
    tensor = (feature.data or {}).get(key)
    if tensor is None:
        raise ValueError(f"mm_features: a {feature.modality} item carries no {key}")
    t, h, w = np.frombuffer(tensor.data, dtype=tensor.dtype).reshape(3).tolist()
    return int(t), int(h), int(w)


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    """hf_config: the whole Qwen2VLConfig. The vision transformer lives on the first pipeline stage (the one
    that embeds), replicated on every TP rank (as Llava's: no all-reduce per encoder layer)."""
    TEXT_PREFIX = _TEXT

    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__()
        self.config, self.pp = hf_config, pp
        text_config = tied_text_config(hf_config)
        self.language_model = Qwen2VLLanguageModel(text_config, tp, pp)
        self.spatial_merge_size = int(hf_config.vision_config.spatial_merge_size)
        self.visual = self.make_vision_tower(hf_config.vision_config) if pp.is_first else None

    def make_vision_tower(self, vision_config: Any) -> torch.nn.Module:
        return Qwen2VLVisionTransformer(vision_config)

    @property
    def image_token_id(self) -> int:
        return image_token_id(self.config)

    def embed_multimodal(self, pixel_values: torch.Tensor | None = None, image_grid_thw: torch.Tensor | None = None,
                         pixel_values_videos: torch.Tensor | None = None,
                         video_grid_thw: torch.Tensor | None = None) -> list[torch.Tensor]:
        """The patches of n images (or n videos) [patches, patch_dim] and their grids [n, 3] -> per item its
        rows [t * h * w / merge^2, text hidden_size] in the model's dtype, one per placeholder token."""
        if self.visual is None:
            raise ValueError(f"pixel_values: pipeline stage {self.pp.rank} holds no vision tower (the first does)")
        if (pixel_values is None) == (pixel_values_videos is None):
            raise ValueError("pixel_values / pixel_values_videos: give the patches of images or of videos")
        modality = "image" if pixel_values is not None else "video"
        pixels, grid = (pixel_values, image_grid_thw) if modality == "image" else (pixel_values_videos, video_grid_thw)
        names = ITEM_TENSORS[modality]
        rows = self._grid_rows(grid, names[1])
        patches = sum(t * h * w for t, h, w in rows)
        if pixels.dim() != 2 or tuple(pixels.shape) != (patches, self.visual.patch_dim):
            raise ValueError(f"{names[0]}: expected [{patches}, {self.visual.patch_dim}] for grids {rows}, got shape "
                             f"{tuple(pixels.shape)}")
        weight = self.visual.merger.mlp[0].weight
        merged = self.visual(pixels.to(weight.device, weight.dtype), rows)
        return list(merged.split([t * h * w // self.spatial_merge_size ** 2 for t, h, w in rows]))

    def _grid_rows(self, grid: torch.Tensor | None, field: str) -> Grid:
        if grid is None or grid.dim() != 2 or grid.shape[1] != 3:
            raise ValueError(f"{field}: expected [n, 3] (t, h, w per item), got "
                             f"{None if grid is None else tuple(grid.shape)}")
        rows = [tuple(int(x) for x in row) for row in grid.tolist()]
        m = self.spatial_merge_size
        if any(t < 1 or h < 1 or w < 1 or h % m or w % m for t, h, w in rows):
            raise ValueError(f"{field}: {rows} must be positive, h and w multiples of spatial_merge_size {m}")
        return rows

    def mrope_positions(self, prompt_len: int, features: Sequence[MultiModalFeature]) -> tuple[np.ndarray, int]:
        """A prompt's M-RoPE positions [3, prompt_len] and the delta of every later token (transformers'
        get_rope_index)."""
        items = [(f.offset, f.length, feature_grid(f), self.temporal_interval(f)) for f in features]
        return mrope_positions(prompt_len, items, self.spatial_merge_size)

    def temporal_interval(self, feature: MultiModalFeature) -> float:
        """The temporal position step between an item's frames (Qwen2.5-VL scales a video's by its fps)."""
        return 1.0

    # ---------------------------------------------------------------- weights

    def canonical_name(self, raw: str) -> str:
        return _canonical(raw)

    def vision_param(self, name: str) -> str | None:
        if not name.startswith(_VISION):
            return None
        return SKIP if self.visual is None else "visual." + name[len(_VISION):]

    def expected_weights(self) -> set[str]:
        """Every canonical checkpoint name this rank needs."""
        names = {self.text_checkpoint_name(name) for name in self.language_model.expected_weights()}
        if self.visual is not None:
            names.update(_VISION + name for name, _ in self.visual.named_parameters())
        return names
