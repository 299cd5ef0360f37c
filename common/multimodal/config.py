"""The multimodal settings, resolved once: what a prompt may hold, and the encoder's budget and cache.

Sizing never errors at run time (vLLM's "exceeds pre-allocated encoder cache size"): the largest item the
model's processor can make is known from its config, and the encoder's step budget and its cache grow to it.
A step's chunk stops before an item whose output finds no room; the requests holding cache entries are those
part-way through an item, which every step advances, so room always comes (core/multimodal/).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.model.model_files import rope_max_positions
from pagedserve.common.multimodal.families import (BIDIRECTIONAL_FAMILIES, DEFAULT_NUM_FRAMES, MODALITIES, ItemRule,
                                                   ProcessorSettings, family_of, item_rules, max_tokens_per_item)

# What --mm-processor-cache-gb defaults to (vLLM's 4 GiB).
DEFAULT_MM_PROCESSOR_CACHE_GB = 4.0


@dataclass(frozen=True)
class MultiModalConfig:
    limit_per_prompt: dict[str, int]         # modality -> most items one prompt may hold
    processor_kwargs: dict[str, Any] = field(compare=False)      # --mm-processor-kwargs, to the HF processor
    processor_cache_gb: float                # --mm-processor-cache-gb: processed items kept, frontend and core alike
    allowed_local_media_path: str | None     # file:// media only under it; None: no file:// URLs
    max_tokens_per_item: int                 # placeholder tokens of the largest item the processor makes
    item_rules: dict[str, ItemRule] = field(compare=False)     # per modality, each item's tensors and shapes
    encoder_budget: int                      # encoder tokens one step may compute
    encoder_cache_size: int                  # encoder-output tokens the workers keep, least recently used
    family: str = ""                         # families.family_of: the frontend expands items by it
    media_io_kwargs: dict[str, Any] = field(default_factory=dict, compare=False)   # --media-io-kwargs
    # positions the rotary table holds past max_model_len: a Qwen2.5-VL video's temporal positions may reach
    # past its tokens' (by its seconds per temporal patch), and no position may pass the table's end
    position_room: int = 0
    # The language model attends both ways among one item's tokens (families.BIDIRECTIONAL_FAMILIES): an item
    # runs whole in one prefill chunk, a prefix hit is cut back to an item's start, and the workers widen each
    # item token's attention to its item's end (vLLM's disable_chunked_mm_input).
    bidirectional_items: bool = False


# kind -> (its own file, its entry in transformers 5's processor_config.json)
_PROCESSOR_FILES = {"image": ("preprocessor_config.json", "image_processor"),
                    "video": ("video_preprocessor_config.json", "video_processor")}


def load_processor_config(folder: str | None, kind: str = "image") -> dict[str, Any]:
    """The image (or video) processor's saved settings in a model folder ({} where it has none): its own
    json file, or its entry of transformers 5's processor_config.json."""
    if folder is None or not os.path.isdir(folder):
        return {}
    own, entry = _PROCESSOR_FILES[kind]
    for name, key in ((own, None), ("processor_config.json", entry)):
        path = os.path.join(folder, name)
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
            data = data.get(key) if key is not None else data
            if isinstance(data, dict):
                return data
    return {}


def processor_settings(folder: str | None, mm_processor_kwargs: dict[str, Any] | None,
                       media_io_kwargs: dict[str, Any] | None) -> ProcessorSettings:
    """The processors' settings as the frontend's processors resolve them: the saved ones with
    --mm-processor-kwargs over them (for images and videos alike), and the frames a video keeps."""
    flag = dict(mm_processor_kwargs or {})
    num_frames = _media_io(media_io_kwargs).get("video", {}).get("num_frames", DEFAULT_NUM_FRAMES)
    if isinstance(num_frames, bool) or not isinstance(num_frames, int) or num_frames < 1:
        raise ValueError(f"media_io_kwargs.video.num_frames must be an integer >= 1, got {num_frames!r} (every "
                         "video must fit the encoder cache, so a video keeps at most that many frames)")
    return ProcessorSettings(image={**load_processor_config(folder, "image"), **flag},
                             video={**load_processor_config(folder, "video"), **flag}, num_frames=num_frames)


# modality -> the --media-io-kwargs keys it takes
_MEDIA_IO_KEYS = {"image": (), "video": ("num_frames",)}


def _media_io(media_io_kwargs: Any) -> dict[str, dict[str, Any]]:
    """--media-io-kwargs, checked: {modality: {key: value}} with the keys each modality takes."""
    if media_io_kwargs is None:
        return {}
    if not isinstance(media_io_kwargs, dict):
        raise ValueError(f"media_io_kwargs must be a JSON object, got {media_io_kwargs!r}")
    for modality, kwargs in media_io_kwargs.items():
        if modality not in _MEDIA_IO_KEYS or not isinstance(kwargs, dict):
            raise ValueError(f"media_io_kwargs.{modality}: expected one of {', '.join(_MEDIA_IO_KEYS)} mapped to an "
                             f"object, got {kwargs!r}")
        unknown = sorted(set(kwargs) - set(_MEDIA_IO_KEYS[modality]))
        if unknown:
            raise ValueError(f"media_io_kwargs.{modality}: unknown key(s) {', '.join(unknown)} (known: "
                             f"{', '.join(_MEDIA_IO_KEYS[modality]) or 'none'})")
    return media_io_kwargs


def resolve_multimodal(full_config: Any, limit_mm_per_prompt: dict[str, Any] | None,
                       mm_processor_kwargs: dict[str, Any] | None, mm_processor_cache_gb: float,
                       allowed_local_media_path: str | None, max_num_batched_tokens: int,
                       model_folder: str | None = None,
                       media_io_kwargs: dict[str, Any] | None = None,
                       max_model_len: int | None = None) -> MultiModalConfig | None:
    """The config for a multimodal checkpoint (None for a text model); ValueError naming the flag.
    model_folder: where the processors' saved settings are (None: their defaults). max_model_len: the
    engine's (None: the rotary table's own length, so no room past it)."""
    family = family_of(full_config)
    if family is None:
        if limit_mm_per_prompt and any(v for v in limit_mm_per_prompt.values()):
            raise ValueError(f"limit_mm_per_prompt: this model takes text only, got {limit_mm_per_prompt}")
        return None
    limits = _limits(family, limit_mm_per_prompt)
    settings = processor_settings(model_folder, mm_processor_kwargs, media_io_kwargs)
    per_item = max_tokens_per_item(family, full_config, settings)
    bidirectional = family in BIDIRECTIONAL_FAMILIES
    if bidirectional and max_num_batched_tokens < per_item:
        raise ValueError(f"max_num_batched_tokens: {max_num_batched_tokens} cannot hold one image of {per_item} "
                         f"tokens; this model attends both ways among an image's tokens, so an image is never split "
                         f"over prefill chunks (disable_chunked_mm_input): raise --max-num-batched-tokens to at "
                         f"least {per_item}")
    if mm_processor_cache_gb < 0:
        raise ValueError(f"mm_processor_cache_gb must be >= 0, got {mm_processor_cache_gb}")
    return MultiModalConfig(
        limit_per_prompt=limits, processor_kwargs=dict(mm_processor_kwargs or {}),
        processor_cache_gb=float(mm_processor_cache_gb), allowed_local_media_path=allowed_local_media_path,
        max_tokens_per_item=per_item, item_rules=item_rules(family, full_config),
        encoder_budget=max(max_num_batched_tokens, per_item),
        encoder_cache_size=max(max_num_batched_tokens, per_item), family=family,
        media_io_kwargs=dict(media_io_kwargs or {}), bidirectional_items=bidirectional,
        position_room=_position_room(full_config, max_model_len))


def _position_room(full_config: Any, max_model_len: int | None) -> int:
    positions = rope_max_positions(getattr(full_config, "text_config", None) or full_config)
    return max(0, positions - (positions if max_model_len is None else max_model_len))


def _limits(family: str, asked: dict[str, Any] | None) -> dict[str, int]:
    taken = MODALITIES[family]
    limits = {m: 999 for m in taken}            # vLLM's default for every modality the model takes
    for modality, value in (asked or {}).items():
        if modality not in ("image", "video", "audio"):
            raise ValueError(f"limit_mm_per_prompt: unknown modality {modality!r} (image, video)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"limit_mm_per_prompt.{modality} must be an integer >= 0, got {value!r}")
        if modality not in taken and value:
            raise ValueError(f"limit_mm_per_prompt.{modality}: this model takes {', '.join(taken)} only")
        limits[modality] = value
    return {m: n for m, n in limits.items() if m in taken}
