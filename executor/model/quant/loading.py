"""Switching a model's layers to packed loading, packing them afterwards, and counting weight bytes."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor.model.quant.packing import packed_nbytes

# Methods whose layers load in pieces and pack afterwards; anything else loads dense, as before.
PACKED_METHODS = ("gguf", "awq", "gptq", "int8", "fp8")


def _packable(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "begin_packed_load")]


def begin_packed(model: nn.Module) -> None:
    for module in _packable(model):
        module.begin_packed_load()


def finish_packed(model: nn.Module, method: str, device: torch.device, dtype: torch.dtype) -> None:
    for module in _packable(model):
        module.finish_packed_load(method, device, dtype)


def weight_bytes(model: nn.Module) -> int:
    """Bytes the model's weights hold: dense parameters plus packed forms, a shared tensor counted once."""
    total, seen = 0, set()
    for param in model.parameters():             # parameters() yields a shared (tied) tensor once
        total += param.numel() * param.element_size()
    for module in _packable(model):
        packed = getattr(module, "packed", None)
        if packed is not None and id(packed) not in seen:
            seen.add(id(packed))
            total += packed_nbytes(packed)
    return total


def num_weights(model: nn.Module) -> int:
    """How many weights the model has, whatever form they are held in."""
    total = sum(p.numel() for p in model.parameters())
    for module in _packable(model):
        packed = getattr(module, "packed", None)
        if packed is None:
            continue
        if hasattr(module, "in_features"):
            total += module.out_features * module.in_features
        elif getattr(module, "tied_to", None) is None:
            total += module.shard_size * module.hidden_size
    return total
