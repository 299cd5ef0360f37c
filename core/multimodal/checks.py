"""The core's check of a request's multimodal items (its trust boundary: any client may send anything)."""
from __future__ import annotations

import math
import struct
from typing import Any

from pagedserve.common.errors import RequestError
from pagedserve.common.multimodal.config import MultiModalConfig
from pagedserve.common.multimodal.families import ItemRule
from pagedserve.ipc.messages import MultiModalFeature, TensorData

# dtype name -> bytes per element: the dtypes a processor's outputs come in
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "uint8": 1, "bool": 1}
_FIELD = "multi_modal_data"


def check_mm_features(features: list[MultiModalFeature] | None, num_prompt_tokens: int,
                      config: MultiModalConfig | None) -> list[MultiModalFeature]:
    """The items, checked: within the limits, placed inside the prompt without overlap, each small enough
    for the encoder cache, their tensors whole. RequestError naming the reason."""
    if not features:
        return []
    if config is None:
        raise RequestError.at(_FIELD, "this model takes text only")
    counts: dict[str, int] = {}
    end = 0
    reach = num_prompt_tokens - 1          # the highest position the prompt's tokens may take
    for i, item in enumerate(features):
        _check_part(features, i)
        counts[item.modality] = counts.get(item.modality, 0) + (item.part == 0)
        limit = config.limit_per_prompt.get(item.modality, 0)
        if counts[item.modality] > limit:
            raise RequestError.at(_FIELD, f"at most {limit} {item.modality} item(s) per prompt "
                                  "(--limit-mm-per-prompt)")
        if item.offset < end or item.length <= 0 or item.offset + item.length > num_prompt_tokens:
            raise RequestError.at(f"{_FIELD}[{i}]", "its placeholder tokens must lie inside the prompt, after the "
                                  "item before it")
        if item.data is None:
            raise RequestError.at(f"{_FIELD}[{i}]", "the item's processed data is missing")
        rule = config.item_rules.get(item.modality)
        if rule is None or sorted(item.data) != sorted(rule.shapes):
            raise RequestError.at(f"{_FIELD}[{i}]", f"the item holds {sorted(item.data)}, where the model reads "
                                  f"{sorted(rule.shapes) if rule else 'no ' + item.modality}")
        patches, length = _item_size(f"{_FIELD}[{i}]", item.data, rule, config.max_tokens_per_item)
        if item.length != length:
            raise RequestError.at(f"{_FIELD}[{i}]", f"{item.length} placeholder tokens, where the model's item "
                                  f"takes {length}")
        for name, tensor in item.data.items():
            shape = [patches if d == -1 else d for d in rule.shapes[name]]
            _check_tensor(f"{_FIELD}[{i}].{name}", tensor, shape)
        if rule.seconds is not None:
            reach = max(reach, item.offset + _temporal_reach(f"{_FIELD}[{i}].{rule.seconds}", item.data, rule))
        end = item.offset + item.length
    if reach - (num_prompt_tokens - 1) > config.position_room:
        raise RequestError.at(_FIELD, f"a video's temporal positions reach {reach - num_prompt_tokens + 1} past the "
                              f"prompt's, more than the {config.position_room} the rotary table holds past "
                              "max_model_len (too few frames a second for its length)")
    return list(features)


def _temporal_reach(field: str, data: dict[str, TensorData], rule: ItemRule) -> int:
    """How far past its first position a video's last temporal position lies: (t - 1) * tokens_per_second *
    its seconds per temporal patch (as the model's M-RoPE spaces them, rounded up), from a positive, finite
    seconds tensor. An upper bound: the model's item starts at or before its offset."""
    seconds = data[rule.seconds]
    if seconds.dtype != "float32":
        raise RequestError.at(field, f"dtype {seconds.dtype!r}, where the model reads float32")
    (value,) = struct.unpack("<f", seconds.data)
    if not math.isfinite(value) or value <= 0:
        raise RequestError.at(field, f"{value}: the seconds a temporal patch spans must be positive and finite")
    t = struct.unpack("<3q", data[rule.grid].data)[0]
    return math.ceil((t - 1) * rule.tokens_per_second * value)


def _item_size(field: str, data: dict[str, TensorData], rule: ItemRule, max_tokens: int) -> tuple[int, int]:
    """(patches, placeholder tokens) of an item: a fixed-size item's are the model's; a dynamic one's come
    from its grid [[t, h, w]], whose tokens must fit the largest item the processor makes."""
    if rule.grid is None:
        return 0, max_tokens
    where = f"{field}.{rule.grid}"
    grid = data[rule.grid]
    if grid.dtype != "int64":
        raise RequestError.at(where, f"dtype {grid.dtype!r}, where the model reads int64")
    _check_tensor(where, grid, [1, 3])
    t, h, w = struct.unpack("<3q", grid.data)
    if t < 1 or h < 1 or w < 1 or h % rule.merge or w % rule.merge:
        raise RequestError.at(where, f"[{t}, {h}, {w}]: t, h and w must be positive, h and w multiples of "
                              f"{rule.merge}")
    tokens = t * h * w // rule.merge ** 2
    if tokens > max_tokens:
        raise RequestError.at(where, f"[{t}, {h}, {w}] makes {tokens} tokens, more than the {max_tokens} of the "
                              "largest item the processor makes (max_pixels)")
    return t * h * w, tokens


def _check_part(features: list[MultiModalFeature], i: int) -> None:
    """A sub-image follows its image's part before it, so counting parts 0 counts the images."""
    item = features[i]
    before = features[i - 1] if i else None
    if item.part == 0 or (before is not None and before.modality == item.modality and before.part == item.part - 1):
        return
    raise RequestError.at(f"{_FIELD}[{i}].part", f"part {item.part} must follow part {item.part - 1} of the "
                          "same image")


def _check_tensor(field: str, tensor: TensorData, shape: list[int]) -> None:
    if list(tensor.shape) != shape:
        raise RequestError.at(field, f"shape {tensor.shape}, where the model reads {shape}")
    size = _ITEMSIZE.get(tensor.dtype)
    if size is None:
        raise RequestError.at(field, f"dtype {tensor.dtype!r} is not one of {', '.join(_ITEMSIZE)}")
    if any(d < 0 for d in tensor.shape) or math.prod(tensor.shape) * size != len(tensor.data):
        raise RequestError.at(field, f"{len(tensor.data)} bytes do not hold a {tensor.dtype} tensor of shape "
                              f"{tensor.shape}")


def multimodal_info(config: MultiModalConfig | None) -> dict[str, Any]:
    """What EngineInfo tells a frontend of the multimodal settings (nothing for a text model)."""
    if config is None:
        return {}
    return {"mm_family": config.family, "mm_media_io_kwargs": dict(config.media_io_kwargs),
            "mm_limits": dict(config.limit_per_prompt),
            "mm_processor_kwargs": dict(config.processor_kwargs),
            "allowed_local_media_path": config.allowed_local_media_path,
            "mm_max_tokens_per_item": config.max_tokens_per_item, "mm_processor_cache_gb": config.processor_cache_gb}
