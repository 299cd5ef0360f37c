"""What the engine needs to know of each multimodal family before any image arrives: the modalities it takes
and the most placeholder tokens one item can become (the encoder budget's size). The processing itself is the
HF processor's (frontend/multimodal/), the model the executor's."""
from __future__ import annotations

from typing import Any

# model_type of the checkpoint's top-level config -> family
_FAMILIES = {"llava": "llava", "idefics3": "idefics3"}
MODALITIES: dict[str, tuple[str, ...]] = {"llava": ("image",), "idefics3": ("image",)}


def family_of(full_config: Any) -> str | None:
    """The multimodal family of a checkpoint's top-level config; None for a text model."""
    return _FAMILIES.get(getattr(full_config, "model_type", None))


def image_token_id(full_config: Any) -> int:
    """The placeholder token an item's rows replace (Llava's older configs call it image_token_index)."""
    value = getattr(full_config, "image_token_id", None)
    return int(value if value is not None else full_config.image_token_index)


def max_tokens_per_item(family: str, full_config: Any, processor_kwargs: dict[str, Any]) -> int:
    if family == "llava":
        vision = full_config.vision_config
        patches = (vision.image_size // vision.patch_size) ** 2
        # "default" drops the CLS token's feature, "full" keeps it
        return patches + (1 if full_config.vision_feature_select_strategy == "full" else 0)
    if family == "idefics3":
        # An item is one sub-image (the processor splits an image into a grid plus a global view): its
        # patches, pixel-shuffled by scale_factor in each direction (the processor's image_seq_len).
        vision = full_config.vision_config
        return (vision.image_size // vision.patch_size) ** 2 // full_config.scale_factor ** 2
    raise ValueError(f"no token count for multimodal family {family!r}")


def item_shapes(family: str, full_config: Any) -> dict[str, list[int]]:
    """The tensors one item carries and their exact shapes: the core refuses any other (a hostile client's
    shapes would otherwise fail the vision tower inside a step, every request of the batch with it)."""
    if family == "llava":
        vision = full_config.vision_config
        size = vision.image_size
        return {"pixel_values": [1, getattr(vision, "num_channels", 3), size, size]}
    if family == "idefics3":        # each sub-image (and the global view) at the tower's size, with its mask
        size = full_config.vision_config.image_size
        return {"pixel_values": [1, getattr(full_config.vision_config, "num_channels", 3), size, size],
                "pixel_attention_mask": [1, size, size]}
    raise ValueError(f"no item shapes for multimodal family {family!r}")
