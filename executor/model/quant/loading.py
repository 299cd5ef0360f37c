"""Switching a model's layers to packed loading, packing them afterwards, and counting weight bytes.

A weight update of a quantized model (executor/worker/rl/model_update.py) goes through the same two steps: the
layers collect the update's pieces while their current packed weights keep serving, then the layers that got
pieces pack them with the same rules (quant/packing.py)."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.quant.packing import check_all_rows, packed_nbytes

# Methods whose layers load in pieces and pack afterwards; anything else loads dense, as before.
PACKED_METHODS = ("gguf", "awq", "gptq", "int8", "fp8")


def _packable(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if hasattr(m, "begin_packed_load")]


def begin_packed(model: nn.Module) -> None:
    for module in _packable(model):
        module.begin_packed_load()


def finish_packed(model: nn.Module, method: str, device: torch.device, dtype: torch.dtype) -> bool:
    """Pack every layer's pieces; True when some layer's weight tensors were replaced (not overwritten in
    place): whatever bound their addresses must bind them again."""
    replaced = False
    for module in _packable(model):
        replaced |= bool(module.finish_packed_load(method, device, dtype))
    return replaced


def _updatable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    return [(name, m) for name, m in model.named_modules() if hasattr(m, "begin_packed_update")]


def begin_packed_update(model: nn.Module, pieces: Callable[[], list] | None = None) -> None:
    """Every packable layer collects an update's pieces (each into pieces() when given) and keeps serving."""
    for _, module in _updatable(model):
        module.begin_packed_update(None if pieces is None else pieces())


def end_packed_update(model: nn.Module) -> None:
    """Drop whatever pieces the layers collected (a failed update's)."""
    for _, module in _updatable(model):
        module.take_pieces()


def check_update_pieces(model: nn.Module) -> None:
    """Drop the pieces the layers collected, after checking them: ValueError naming the first layer that got
    some of its pieces but not all (see packing.check_all_rows)."""
    for name, module in _updatable(model):
        pieces = module.take_pieces()
        if pieces:
            check_all_rows(pieces, module.piece_rows(), name)


def _form_tensors(form: Any) -> Iterator[torch.Tensor]:
    if isinstance(form, torch.Tensor):
        yield form
    elif dataclasses.is_dataclass(form):
        for field in dataclasses.fields(form):
            yield from _form_tensors(getattr(form, field.name))


def packed_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every tensor of the model's packed weights (not parameters: sleep mode releases them too)."""
    out: list[torch.Tensor] = []
    for module in _packable(model):
        out += _form_tensors(getattr(module, "packed", None))
    return out


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
