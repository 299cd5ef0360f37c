"""Idefics3 (Idefics3ForConditionalGeneration; SmolVLM is one): a SigLIP-style vision transformer, a connector
(pixel shuffle by `scale_factor`, then one linear map without bias into the text model's embedding space) and a
registered causal LM (Llama in SmolVLM) that reads the connector's rows in place of the `<image>` tokens'.

The processor splits an image into a grid of sub-images plus a global view, each `image_seq_len` `<image>`
tokens long; the frontend sends each sub-image as its own item, so `embed_multimodal` encodes sub-images
(independently: the tower's attention never crosses images, so this equals HF's batched encoding).

Checkpoint names are canonicalised to the layout transformers 5's save_pretrained writes, which the hub's
checkpoints share (`model.vision_model.*`, `model.connector.*`, `model.text_model.*`, `lm_head.*`); the bare
Idefics3Model's names (no `model.` prefix) are renamed to it (_canonical).
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn

from pagedserve.common.multimodal.families import image_token_id
from pagedserve.executor.model.models import text_model_class
from pagedserve.executor.model.models.vision.idefics3_vision import Idefics3VisionTransformer
from pagedserve.executor.model.models.vision.vlm import SKIP, VisionLanguageModel, tied_text_config
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup

_TEXT = "model.text_model."
# checkpoint prefix -> this module's own, for the vision side
_VISION = {"model.vision_model.": "vision_model.", "model.connector.": "connector."}
_BARE = ("vision_model.", "connector.", "text_model.")        # Idefics3Model saved on its own


def _canonical(name: str) -> str:
    return "model." + name if name.startswith(_BARE) else name


class Idefics3SimpleMLP(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        features = hf_config.vision_config.hidden_size * hf_config.scale_factor ** 2
        self.proj = nn.Linear(features, hf_config.text_config.hidden_size, bias=False)


class Idefics3Connector(nn.Module):
    def __init__(self, hf_config: Any) -> None:
        super().__init__()
        self.scale = int(hf_config.scale_factor)
        self.modality_projection = Idefics3SimpleMLP(hf_config)

    def pixel_shuffle(self, x: torch.Tensor) -> torch.Tensor:
        """[n, side * side, d] -> [n, (side / s)^2, s * s * d]: each output token is an s x s block of the
        patch grid, its features ordered by the block's row, then column, then channel (HF's order)."""
        n, tokens, dim = x.shape
        side, s = int(round(tokens ** 0.5)), self.scale
        if side * side != tokens or side % s:
            raise ValueError(f"pixel_values: {tokens} patches are no square grid divisible by scale_factor {s}")
        blocks = x.view(n, side // s, s, side // s, s, dim).permute(0, 1, 3, 2, 4, 5)
        return blocks.reshape(n, (side // s) ** 2, s * s * dim)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        return self.modality_projection.proj(self.pixel_shuffle(states))


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    """hf_config: the whole Idefics3Config. The vision transformer and connector live on the first pipeline
    stage (the one that embeds); every stage holds its share of the language model."""
    TEXT_PREFIX = _TEXT

    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__()
        self.config, self.pp = hf_config, pp
        text_config = tied_text_config(hf_config)
        self.language_model = text_model_class(text_config)(text_config, tp, pp)
        self.vision_model: Idefics3VisionTransformer | None = None
        self.connector: Idefics3Connector | None = None
        if pp.is_first:
            # Replicated on every TP rank, not sharded: the tower is small, and a whole copy per rank saves an
            # all-reduce per encoder layer (vLLM's mm_encoder_tp_mode="data" does the same).
            self.vision_model = Idefics3VisionTransformer(hf_config.vision_config)
            self.connector = Idefics3Connector(hf_config)

    @property
    def image_token_id(self) -> int:
        """The placeholder token each sub-image's rows replace, one per row."""
        return image_token_id(self.config)

    def embed_multimodal(self, pixel_values: torch.Tensor,
                         pixel_attention_mask: torch.Tensor | None = None) -> list[torch.Tensor]:
        """pixel_values [n, channels, H, W] and pixel_attention_mask [n, H, W] (1: a real pixel; absent: all
        real), n sub-images -> per sub-image its rows [image_seq_len, text hidden_size] in the model's dtype."""
        if self.vision_model is None or self.connector is None:
            raise ValueError(f"pixel_values: pipeline stage {self.pp.rank} holds no vision tower (the first does)")
        if pixel_values.dim() != 4:
            raise ValueError(f"pixel_values: expected [n_images, channels, H, W], got shape "
                             f"{tuple(pixel_values.shape)}")
        n, _, height, width = pixel_values.shape
        if pixel_attention_mask is None:
            pixel_attention_mask = torch.ones(n, height, width, dtype=torch.bool, device=pixel_values.device)
        elif tuple(pixel_attention_mask.shape) != (n, height, width):
            raise ValueError(f"pixel_attention_mask: expected shape {(n, height, width)} (pixel_values' images), "
                             f"got {tuple(pixel_attention_mask.shape)}")
        weight = self.connector.modality_projection.proj.weight
        states = self.vision_model(pixel_values.to(weight.device, weight.dtype), pixel_attention_mask.to(weight.device))
        return list(self.connector(states).unbind(0))

    # ---------------------------------------------------------------- weights

    def canonical_name(self, raw: str) -> str:
        return _canonical(raw)

    def vision_param(self, name: str) -> str | None:
        own = _own_name(name)
        if own is not None and self.vision_model is None:
            return SKIP             # a later pipeline stage: the first holds the vision side
        return own

    def expected_weights(self) -> set[str]:
        """Every canonical checkpoint name this rank needs."""
        names = {self.text_checkpoint_name(name) for name in self.language_model.expected_weights()}
        for prefix, own in _VISION.items():
            module = getattr(self, own[:-1])
            if module is not None:
                names.update(prefix + name for name, _ in module.named_parameters())
        return names


def _own_name(name: str) -> str | None:
    """A canonical vision-side name as this module names the parameter; None for no vision-side name."""
    for prefix, own in _VISION.items():
        if name.startswith(prefix):
            return own + name[len(prefix):]
    return None

