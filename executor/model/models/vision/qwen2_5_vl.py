"""Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): Qwen2-VL's layout, language model and M-RoPE, with the
window-attention tower (vision/qwen2_5_vl_vision.py). A video's temporal positions step by
tokens_per_second * second_per_grid_ts (the seconds one temporal patch spans, which the frontend computes from
the kept frames' rate and the core checks); the tower does not read it."""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from pagedserve.executor.model.models.vision.qwen2_vl import Qwen2VLForConditionalGeneration
from pagedserve.executor.model.models.vision.qwen2_5_vl_vision import Qwen2_5_VLVisionTransformer
from pagedserve.ipc.messages import MultiModalFeature


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):
    def make_vision_tower(self, vision_config: Any) -> torch.nn.Module:
        return Qwen2_5_VLVisionTransformer(vision_config)

    def embed_multimodal(self, second_per_grid_ts: torch.Tensor | None = None,
                         **tensors: torch.Tensor) -> list[torch.Tensor]:
        return super().embed_multimodal(**tensors)

    def temporal_interval(self, feature: MultiModalFeature) -> float:
        if feature.modality != "video":
            return 1.0          # an image has no time to space out (transformers #45325)
        seconds = (feature.data or {}).get("second_per_grid_ts")
        per_patch = float(np.frombuffer(seconds.data, dtype=seconds.dtype)[0]) if seconds is not None else 1.0
        return float(self.config.vision_config.tokens_per_second) * per_patch
