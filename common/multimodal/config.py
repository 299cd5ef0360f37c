"""The multimodal settings, resolved once: what a prompt may hold, and the encoder's budget and cache.

Sizing never errors at run time (vLLM's "exceeds pre-allocated encoder cache size"): the largest item the
model's processor can make is known from its config, and the encoder's step budget and its cache grow to it.
A step's chunk stops before an item whose output finds no room; the requests holding cache entries are those
part-way through an item, which every step advances, so room always comes (core/multimodal/).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from pagedserve.common.multimodal.families import MODALITIES, family_of, item_shapes, max_tokens_per_item

# What --mm-processor-cache-gb defaults to (vLLM's 4 GiB).
DEFAULT_MM_PROCESSOR_CACHE_GB = 4.0


@dataclass(frozen=True)
class MultiModalConfig:
    limit_per_prompt: dict[str, int]         # modality -> most items one prompt may hold
    processor_kwargs: dict[str, Any] = field(compare=False)      # --mm-processor-kwargs, to the HF processor
    processor_cache_gb: float                # --mm-processor-cache-gb: the frontend's processed-item cache
    allowed_local_media_path: str | None     # file:// media only under it; None: no file:// URLs
    max_tokens_per_item: int                 # placeholder tokens of the largest item the processor makes
    item_shapes: dict[str, list[int]] = field(compare=False)    # each item's tensors, exactly these shapes
    encoder_budget: int                      # encoder tokens one step may compute
    encoder_cache_size: int                  # encoder-output tokens the workers keep, least recently used


def resolve_multimodal(full_config: Any, limit_mm_per_prompt: dict[str, Any] | None,
                       mm_processor_kwargs: dict[str, Any] | None, mm_processor_cache_gb: float,
                       allowed_local_media_path: str | None, max_num_batched_tokens: int) -> MultiModalConfig | None:
    """The config for a multimodal checkpoint (None for a text model); ValueError naming the flag."""
    family = family_of(full_config)
    if family is None:
        if limit_mm_per_prompt and any(v for v in limit_mm_per_prompt.values()):
            raise ValueError(f"limit_mm_per_prompt: this model takes text only, got {limit_mm_per_prompt}")
        return None
    limits = _limits(family, limit_mm_per_prompt)
    per_item = max_tokens_per_item(family, full_config, mm_processor_kwargs or {})
    if mm_processor_cache_gb < 0:
        raise ValueError(f"mm_processor_cache_gb must be >= 0, got {mm_processor_cache_gb}")
    return MultiModalConfig(
        limit_per_prompt=limits, processor_kwargs=dict(mm_processor_kwargs or {}),
        processor_cache_gb=float(mm_processor_cache_gb), allowed_local_media_path=allowed_local_media_path,
        max_tokens_per_item=per_item, item_shapes=item_shapes(family, full_config),
        encoder_budget=max(max_num_batched_tokens, per_item),
        encoder_cache_size=max(max_num_batched_tokens, per_item))


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
