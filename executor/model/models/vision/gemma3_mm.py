"""Gemma 3 (Gemma3ForConditionalGeneration): a SigLIP vision tower, a projector (the patch grid average-pooled
to `mm_tokens_per_image` cells, a Gemma (1 + w) RMSNorm, one matrix into the text model's width) and the
Gemma 3 text model, which reads the projector's rows in place of the image tokens'.

The text model attends bidirectionally among the tokens of one image (HF's `token_type_ids` mask): the engine
builds that mask per step from the request's item placements (executor/worker/multimodal/item_bounds.py), so
the model itself only declares it (families.BIDIRECTIONAL_FAMILIES).

Checkpoint names are canonicalised to the layout transformers 5's save_pretrained writes for Gemma 3
(`language_model.model.*`, `vision_tower.*`, `multi_modal_projector.*`; the head tied, else
`language_model.lm_head.*`). The hub's classic names (`vision_tower.vision_model.*`) and transformers 5's
in-memory names (`model.language_model.*`, `model.vision_tower.*`, `lm_head.*`) are renamed to it.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.common.multimodal.families import image_token_id
from pagedserve.executor.model.models.gemma import Gemma3ForCausalLM, GemmaRMSNorm
from pagedserve.executor.model.models.vision.idefics3_vision import Idefics3Encoder, Idefics3VisionEmbeddings
from pagedserve.executor.model.models.vision.vlm import (SKIP, VisionLanguageModel, tied_text_config,
                                                         tower_canonical_name)
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup

_LM = "language_model."
_VISION_TYPES = ("siglip_vision_model", "siglip")


class SiglipVisionTower(nn.Module):
    """SigLIP's vision transformer without its pooling head: patch convolution, one learned position per
    patch of the (fixed-size) grid, pre-LN encoder layers attending over the whole image, a final LayerNorm.
    Idefics3's tower shares its modules and names; its NaViT position buckets equal plain positions for a whole
    image, but the positions here are taken as they are (no float bucketing to get right)."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        model_type = getattr(cfg, "model_type", "siglip_vision_model")
        if model_type not in _VISION_TYPES:
            raise ValueError(f"vision_config.model_type: {model_type!r} is not supported (supported: "
                             "siglip_vision_model)")
        self.embeddings = Idefics3VisionEmbeddings(cfg)
        self.encoder = Idefics3Encoder(cfg)
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    @property
    def side(self) -> int:
        return self.embeddings.side

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [n, channels, H, W] at the tower's size -> [n, side * side, hidden]."""
        emb = self.embeddings
        h = emb.patch_embedding(pixel_values).flatten(2).transpose(1, 2) + emb.position_embedding.weight[None]
        for layer in self.encoder.layers:
            h = layer(h)
        return self.post_layernorm(h)


class Gemma3MultiModalProjector(nn.Module):
    """[n, side^2, vision hidden] -> [n, mm_tokens_per_image, text hidden]: the patch grid average-pooled in
    square cells, normed, then multiplied by mm_input_projection_weight [vision hidden, text hidden] (a bare
    matrix in HF's checkpoint, not a Linear's transposed weight)."""

    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        vision = hf_config.vision_config
        self.side = int(vision.image_size // vision.patch_size)
        tokens_side = int(round(hf_config.mm_tokens_per_image ** 0.5))
        if tokens_side ** 2 != hf_config.mm_tokens_per_image or self.side % tokens_side:
            raise ValueError(f"mm_tokens_per_image: {hf_config.mm_tokens_per_image} is no square whose side divides "
                             f"the {self.side} x {self.side} patch grid")
        self.kernel = self.side // tokens_side
        self.mm_input_projection_weight = nn.Parameter(
            torch.empty(vision.hidden_size, hf_config.text_config.hidden_size), requires_grad=False)
        self.mm_soft_emb_norm = GemmaRMSNorm(vision.hidden_size, vision.layer_norm_eps)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        n, _, dim = states.shape
        grid = states.transpose(1, 2).reshape(n, dim, self.side, self.side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight).type_as(states)


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    """hf_config: the whole Gemma3Config. Gemma runs in one pipeline stage, so this rank holds the tower (replicated
    on every TP rank: small beside the text model, and no all-reduce per encoder layer) and its TP share of the
    text model."""

    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__()
        if pp.size > 1:
            raise ValueError("pipeline_parallel_size: Gemma 3 runs in one pipeline stage")
        self.config, self.pp = hf_config, pp
        text_config = tied_text_config(hf_config)
        if getattr(text_config, "model_type", "gemma3_text") != "gemma3_text":
            raise ValueError(f"text_config.model_type: {text_config.model_type!r} is not supported (gemma3_text)")
        self.language_model = Gemma3ForCausalLM(text_config, tp)
        self.vision_tower = SiglipVisionTower(hf_config.vision_config)
        self.multi_modal_projector = Gemma3MultiModalProjector(hf_config)

    @property
    def image_token_id(self) -> int:
        """The placeholder token each image's rows replace, one per row."""
        return image_token_id(self.config)

    def make_decode_step(self) -> Any:
        return None             # the Gemma text model has no whole-decoder C step

    def embed_multimodal(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [n, channels, H, W] -> per image its rows [mm_tokens_per_image, text hidden_size]."""
        size = self.vision_tower.side * self.vision_tower.embeddings.patch_size
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[2:]) != (size, size):
            raise ValueError(f"pixel_values: expected [n_images, channels, {size}, {size}], got shape "
                             f"{tuple(pixel_values.shape)}")
        weight = self.multi_modal_projector.mm_input_projection_weight
        states = self.vision_tower(pixel_values.to(weight.device, weight.dtype))
        return list(self.multi_modal_projector(states).unbind(0))

    # ---------------------------------------------------------------- weights

    def canonical_name(self, raw: str) -> str:
        return tower_canonical_name(raw)

    def text_name(self, name: str) -> str | None:
        return name[len(_LM):] if name.startswith(_LM) else None

    def vision_param(self, name: str) -> str | None:
        # SigLIP's pooling head (vision_use_head) and old checkpoints' position_ids buffer: Gemma reads neither
        if name.startswith(("vision_tower.head.", "vision_tower.embeddings.position_ids")):
            return SKIP
        return name if name.startswith(("vision_tower.", "multi_modal_projector.")) else None

    def text_checkpoint_name(self, name: str) -> str:
        return _LM + name

    def expected_weights(self) -> set[str]:
        """Every canonical checkpoint name this rank needs."""
        names = {_LM + name for name in self.language_model.expected_weights()}
        for prefix, module in (("vision_tower.", self.vision_tower),
                               ("multi_modal_projector.", self.multi_modal_projector)):
            names.update(prefix + name for name, _ in module.named_parameters())
        return names
