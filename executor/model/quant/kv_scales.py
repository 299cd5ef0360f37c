"""Per-layer fp8 KV-cache scales from a checkpoint, taken out of the weight stream and set on the attention
layers. Names as vLLM reads them: `layers.N.self_attn.k_scale` / `v_scale` (also under `.attn.`),
`kv_scale` (one scale for both, older AutoFP8 files) and `k_proj.output_scale` / `v_proj.output_scale`
(the K/V projections' calibrated output scales). A layer without one keeps 1.0, as in vLLM.
"""
from __future__ import annotations

import logging
import math
import re
from collections.abc import Iterator, Sequence

import torch

logger = logging.getLogger(__name__)

_SCALE_NAME = re.compile(r"(?:^|\.)layers\.(\d+)\.(?:.*\.)?(k_scale|v_scale|kv_scale|k_proj\.output_scale|"
                         r"v_proj\.output_scale)$")
# Which of the layer's two scales a checkpoint name sets.
_TARGETS = {"k_scale": ("k",), "v_scale": ("v",), "kv_scale": ("k", "v"),
            "k_proj.output_scale": ("k",), "v_proj.output_scale": ("v",)}


def take_kv_scales(weights: Iterator[tuple[str, torch.Tensor]],
                   found: dict[int, dict[str, float]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The stream without its KV-cache scales; each one goes into found[layer]["k" | "v"] as a float."""
    for name, tensor in weights:
        match = _SCALE_NAME.search(name)
        if match is None:
            yield name, tensor
            continue
        if tensor.numel() != 1:
            raise ValueError(f"{name}: an fp8 KV-cache scale must be one number per layer (per tensor), "
                             f"got shape {tuple(tensor.shape)}")
        value = float(tensor.float().item())
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name}: an fp8 KV-cache scale must be a positive finite number, got {value}")
        for which in _TARGETS[match.group(2)]:
            found.setdefault(int(match.group(1)), {})[which] = value


def apply_kv_scales(layers: Sequence, found: dict[int, dict[str, float]]) -> None:
    """Set k_scale / v_scale on attention layer i from found[i] (layers list them in model order)."""
    if not found:
        return
    outside = sorted(i for i in found if i >= len(layers))
    if outside:
        raise ValueError(f"checkpoint has KV-cache scales for layers {outside}, the model has {len(layers)}")
    for index, scales in found.items():
        layers[index].k_scale = scales.get("k", layers[index].k_scale)
        layers[index].v_scale = scales.get("v", layers[index].v_scale)
    logger.info("KV-cache scales from the checkpoint for %d of %d layers (used by an fp8 KV cache only)",
                len(found), len(layers))
