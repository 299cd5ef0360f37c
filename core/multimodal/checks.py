"""The core's check of a request's multimodal items (its trust boundary: any client may send anything)."""
from __future__ import annotations

import math
from typing import Any

from pagedserve.common.errors import RequestError
from pagedserve.common.multimodal.config import MultiModalConfig
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
        if item.length != config.max_tokens_per_item:
            raise RequestError.at(f"{_FIELD}[{i}]", f"{item.length} placeholder tokens, where the model's items "
                                  f"take {config.max_tokens_per_item}")
        if item.data is None:
            raise RequestError.at(f"{_FIELD}[{i}]", "the item's processed data is missing")
        if sorted(item.data) != sorted(config.item_shapes):
            raise RequestError.at(f"{_FIELD}[{i}]", f"the item holds {sorted(item.data)}, where the model reads "
                                  f"{sorted(config.item_shapes)}")
        for name, tensor in item.data.items():
            _check_tensor(f"{_FIELD}[{i}].{name}", tensor, config.item_shapes[name])
        end = item.offset + item.length
    return list(features)


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
    return {"mm_limits": dict(config.limit_per_prompt), "mm_processor_kwargs": dict(config.processor_kwargs),
            "allowed_local_media_path": config.allowed_local_media_path,
            "mm_max_tokens_per_item": config.max_tokens_per_item, "mm_processor_cache_gb": config.processor_cache_gb}
