"""What the engine needs to know of each multimodal family before any image arrives: the modalities it takes,
the most placeholder tokens one item can become (the encoder budget's size) and the tensors an item carries.
The processing itself is the HF processor's (frontend/multimodal/), the model the executor's."""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

# model_type of the checkpoint's top-level config -> family
_FAMILIES = {"llava": "llava", "idefics3": "idefics3", "qwen2_vl": "qwen2_vl", "qwen2_5_vl": "qwen2_5_vl",
             "gemma3": "gemma3"}
MODALITIES: dict[str, tuple[str, ...]] = {"llava": ("image",), "idefics3": ("image",),
                                          "qwen2_vl": ("image", "video"), "qwen2_5_vl": ("image", "video"),
                                          "gemma3": ("image",)}
# Qwen2.5-VL's processing is Qwen2-VL's (the same image processor, placeholders and grids); its videos also
# carry the seconds one temporal patch spans, which space out their temporal positions.
QWEN2_VL_FAMILIES = ("qwen2_vl", "qwen2_5_vl")
# Families whose language model attends bidirectionally among the tokens of one item (Gemma 3: HF's
# token_type_ids mask). An item's tokens then run in one prefill chunk, and a prefix hit never ends inside one
# (vLLM's disable_chunked_mm_input): a token's attention reaches to its item's last token.
BIDIRECTIONAL_FAMILIES = frozenset({"gemma3"})

# Dynamic-resolution items (Qwen2-VL): per modality, the patches tensor and the grid tensor [[t, h, w]]
PATCH_TENSORS = {"image": "pixel_values", "video": "pixel_values_videos"}
GRID_TENSORS = {"image": "image_grid_thw", "video": "video_grid_thw"}
# The small tensors a request's placements keep when the workers are told of it (the pixels go with the step
# that encodes the item): the grids its M-RoPE positions are computed from.
SECONDS_TENSOR = "second_per_grid_ts"     # float32 [1]: the seconds one temporal patch of a video spans
PLACEMENT_TENSORS = frozenset((*GRID_TENSORS.values(), SECONDS_TENSOR))

DEFAULT_NUM_FRAMES = 32          # the frames a video keeps (vLLM's video loader's default)
# Qwen2VLImageProcessor's and Qwen2VLVideoProcessor's defaults: {"shortest_edge": min_pixels, "longest_edge":
# max_pixels}
_QWEN2_VL_SIZE = {"image": {"shortest_edge": 56 * 56, "longest_edge": 28 * 28 * 1280},
                  "video": {"shortest_edge": 128 * 28 * 28, "longest_edge": 28 * 28 * 768}}
_QWEN2_VL_MAX_ASPECT = 200       # smart_resize refuses images more elongated than this


@dataclass(frozen=True)
class ItemRule:
    """What one item of a modality carries, as the core checks it (a hostile client's shapes would otherwise
    fail the vision tower inside a step, every request of the batch with it)."""
    shapes: dict[str, list[int]]     # each tensor's exact shape; -1: the item's patches, t * h * w of its grid
    grid: str | None = None          # the int64 [1, 3] tensor of its grid (a dynamic item); None: fixed size
    merge: int = 1                   # a grid's h and w per placeholder token: tokens = t * h * w / merge^2
    seconds: str | None = None       # the float32 [1] tensor of seconds a temporal patch spans (Qwen2.5-VL video)
    tokens_per_second: float = 0.0   # temporal positions per second of video (the tower's config)


@dataclass(frozen=True)
class ProcessorSettings:
    """The processors' settings: their saved ones with --mm-processor-kwargs over them (config.py)."""
    image: dict[str, Any] = field(default_factory=dict)
    video: dict[str, Any] = field(default_factory=dict)
    num_frames: int = DEFAULT_NUM_FRAMES    # the most frames a video keeps (--media-io-kwargs video.num_frames)


def family_of(full_config: Any) -> str | None:
    """The multimodal family of a checkpoint's top-level config; None for a text model."""
    return _FAMILIES.get(getattr(full_config, "model_type", None))


def image_token_id(full_config: Any) -> int:
    """The placeholder token an item's rows replace (Llava's older configs call it image_token_index)."""
    value = getattr(full_config, "image_token_id", None)
    return int(value if value is not None else full_config.image_token_index)


def qwen2_vl_pixels(processor: dict[str, Any], kind: str = "image") -> tuple[int, int]:
    """(min_pixels, max_pixels) of a Qwen2-VL image (or video) processor's settings, resolved as
    Qwen2VLImageProcessor's (Qwen2VLVideoProcessor's) __init__ resolves them."""
    size = dict(processor.get("size") or _QWEN2_VL_SIZE[kind])
    if processor.get("min_pixels") is not None:
        size["shortest_edge"] = processor["min_pixels"]
    if processor.get("max_pixels") is not None:
        size["longest_edge"] = processor["max_pixels"]
    low, high = size.get("shortest_edge"), size.get("longest_edge")
    if not isinstance(low, int) or not isinstance(high, int) or not 0 < low <= high:
        raise ValueError(f"mm_processor_kwargs: min_pixels / max_pixels must be integers with 0 < min <= max, got "
                         f"{low!r} / {high!r}")
    return low, high


def _qwen2_vl_frame_tokens(full_config: Any, processor: dict[str, Any], kind: str) -> int:
    """The most tokens smart_resize lets an image (a frame) become: max_pixels / factor^2 in general; one at
    the aspect limit may keep one factor-high row past max_pixels, and one scaled up to min_pixels may round
    up."""
    vision = full_config.vision_config
    factor = vision.patch_size * vision.spatial_merge_size
    low, high = (p / factor ** 2 for p in qwen2_vl_pixels(processor, kind))
    clamped = math.sqrt(_QWEN2_VL_MAX_ASPECT * high)                # one row of factor x factor cells
    rounded_up = low + 1 + math.sqrt(low / _QWEN2_VL_MAX_ASPECT) + math.sqrt(_QWEN2_VL_MAX_ASPECT * low)
    return int(max(high, clamped, rounded_up))


def _qwen2_vl_max_tokens(full_config: Any, processor: ProcessorSettings) -> int:
    """The largest image, or video of num_frames frames (padded to whole temporal patches)."""
    temporal = -(-processor.num_frames // full_config.vision_config.temporal_patch_size)
    return max(_qwen2_vl_frame_tokens(full_config, processor.image, "image"),
               temporal * _qwen2_vl_frame_tokens(full_config, processor.video, "video"))


def max_tokens_per_item(family: str, full_config: Any, processor: ProcessorSettings) -> int:
    """processor: the processors' settings (read by the families whose items vary in size)."""
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
    if family in QWEN2_VL_FAMILIES:
        return _qwen2_vl_max_tokens(full_config, processor)
    if family == "gemma3":          # every image is resized to the tower's size and pooled to a fixed count
        return int(full_config.mm_tokens_per_image)
    raise ValueError(f"no token count for multimodal family {family!r}")


def item_rules(family: str, full_config: Any) -> dict[str, ItemRule]:
    """Per modality the family takes, the tensors one item carries and their shapes."""
    if family == "llava":
        vision = full_config.vision_config
        size = vision.image_size
        return {"image": ItemRule({"pixel_values": [1, getattr(vision, "num_channels", 3), size, size]})}
    if family == "idefics3":        # each sub-image (and the global view) at the tower's size, with its mask
        size = full_config.vision_config.image_size
        return {"image": ItemRule({"pixel_values": [1, getattr(full_config.vision_config, "num_channels", 3), size,
                                                    size], "pixel_attention_mask": [1, size, size]})}
    if family == "gemma3":
        vision = full_config.vision_config
        size = vision.image_size
        return {"image": ItemRule({"pixel_values": [1, getattr(vision, "num_channels", 3), size, size]})}
    if family in QWEN2_VL_FAMILIES:        # flattened patches, as many as the item's grid has
        vision = full_config.vision_config
        patch_dim = vision.in_channels * vision.temporal_patch_size * vision.patch_size ** 2
        rules = {m: ItemRule({PATCH_TENSORS[m]: [-1, patch_dim], GRID_TENSORS[m]: [1, 3]}, GRID_TENSORS[m],
                             int(vision.spatial_merge_size)) for m in MODALITIES[family]}
        if family == "qwen2_5_vl":
            video = rules["video"]
            rules["video"] = ItemRule({**video.shapes, SECONDS_TENSOR: [1]}, video.grid, video.merge, SECONDS_TENSOR,
                                      float(vision.tokens_per_second))
        return rules
    raise ValueError(f"no item shapes for multimodal family {family!r}")
