"""Llava (LlavaForConditionalGeneration): a CLIP vision tower, a two-layer projector into the text model's
embedding space, and a registered causal LM (Llama, Mistral, Qwen2, Qwen3) that reads the projected image
features in place of the image placeholder tokens' embeddings.

The runner merges the two: `embed_input_ids(ids)`, the rows at `image_token_id` replaced by the concatenated
`embed_multimodal(pixel_values)`, passed to `forward` as inputs_embeds.

Checkpoint names are canonicalised to the layout transformers 5's save_pretrained writes (`language_model.model.*`,
`language_model.lm_head.*`, `vision_tower.*`, `multi_modal_projector.*`), which is this module's own parameter
layout; the hub's classic llava-hf names and transformers 5's in-memory ones are renamed to it
(vlm.tower_canonical_name).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.common.multimodal.families import image_token_id
from pagedserve.executor.model.layers.activation import get_activation
from pagedserve.executor.model.models import text_model_class
from pagedserve.executor.model.models.vision.clip import CLIPVisionTower, hidden_state_indices
from pagedserve.executor.model.models.vision.vlm import SKIP, VisionLanguageModel, tower_canonical_name
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup

_LM = "language_model."
_STRATEGIES = ("default", "full")


class LlavaMultiModalProjector(nn.Module):
    def __init__(self, hf_config: Any, num_feature_layers: int) -> None:
        super().__init__()
        text_hidden = hf_config.text_config.hidden_size
        bias = bool(getattr(hf_config, "multimodal_projector_bias", True))
        self.linear_1 = nn.Linear(hf_config.vision_config.hidden_size * num_feature_layers, text_hidden, bias=bias)
        self.act = get_activation(getattr(hf_config, "projector_hidden_act", "gelu"), "projector_hidden_act")
        self.linear_2 = nn.Linear(text_hidden, text_hidden, bias=bias)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(features)))


class LlavaForConditionalGeneration(VisionLanguageModel):
    """hf_config: the whole LlavaConfig. The vision tower and projector live on the first pipeline stage (the
    one that embeds); every stage holds its share of the language model."""

    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__()
        self.config, self.pp = hf_config, pp
        strategy = getattr(hf_config, "vision_feature_select_strategy", "default")
        if strategy not in _STRATEGIES:
            raise ValueError(f"vision_feature_select_strategy: {strategy!r} is not supported (supported: "
                             f"{', '.join(_STRATEGIES)})")
        self.drop_class_token = strategy == "default"
        vision_config = hf_config.vision_config
        layers = hidden_state_indices(getattr(hf_config, "vision_feature_layer", -2), vision_config.num_hidden_layers)
        text_config = hf_config.text_config
        self.language_model = text_model_class(text_config)(text_config, tp, pp)
        self.vision_tower: CLIPVisionTower | None = None
        self.multi_modal_projector: LlavaMultiModalProjector | None = None
        if pp.is_first:
            # Replicated on every TP rank, not sharded: the tower is small, and a whole copy per rank saves an
            # all-reduce per encoder layer (vLLM's mm_encoder_tp_mode="data" does the same).
            self.vision_tower = CLIPVisionTower(vision_config, layers)
            self.multi_modal_projector = LlavaMultiModalProjector(hf_config, len(layers))

    @property
    def image_token_id(self) -> int:
        """The placeholder token each image's features replace, one per feature row."""
        return image_token_id(self.config)

    def embed_multimodal(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [n_images, channels, H, W] (the HF processor's) -> per image, its features
        [num_image_tokens, text hidden_size] in the model's dtype, one row per placeholder token."""
        if self.vision_tower is None or self.multi_modal_projector is None:
            raise ValueError(f"pixel_values: pipeline stage {self.pp.rank} holds no vision tower (the first does)")
        if pixel_values.dim() != 4:
            raise ValueError(f"pixel_values: expected [n_images, channels, H, W], got shape "
                             f"{tuple(pixel_values.shape)}")
        weight = self.multi_modal_projector.linear_1.weight
        states = self.vision_tower(pixel_values.to(weight.device, weight.dtype))
        if self.drop_class_token:
            states = [s[:, 1:] for s in states]
        return list(self.multi_modal_projector(torch.cat(states, dim=-1)).unbind(0))

    # ---------------------------------------------------------------- weights

    def canonical_name(self, raw: str) -> str:
        return tower_canonical_name(raw)

    def text_name(self, name: str) -> str | None:
        return name[len(_LM):] if name.startswith(_LM) else None

    def vision_param(self, name: str) -> str | None:
        return SKIP if self._skipped(name) else name

    def _skipped(self, name: str) -> bool:
        """A vision-side tensor the model has no use for: the tower's layers past the deepest feature layer, its
        post_layernorm, old checkpoints' position_ids buffer, and everything on a stage without the tower."""
        if not name.startswith(("vision_tower.", "multi_modal_projector.")):
            return False
        if self.vision_tower is None:
            return True
        if name.startswith(("vision_tower.post_layernorm.", "vision_tower.embeddings.position_ids")):
            return True
        parts = name.split(".")
        if parts[1:3] == ["encoder", "layers"] and len(parts) > 3 and parts[3].isdigit():
            # a layer past the checkpoint's own count is no layer of it: refused as unknown
            return self.vision_tower.num_layers <= int(parts[3]) < self.config.vision_config.num_hidden_layers
        return False

    def text_checkpoint_name(self, name: str) -> str:
        return _LM + name

    def expected_weights(self) -> set[str]:
        """Every canonical checkpoint name this rank needs."""
        names = {_LM + name for name in self.language_model.expected_weights()}
        vision = (("vision_tower.", self.vision_tower), ("multi_modal_projector.", self.multi_modal_projector))
        for prefix, module in vision:
            if module is not None:
                names.update(prefix + name for name, _ in module.named_parameters())
        return names
