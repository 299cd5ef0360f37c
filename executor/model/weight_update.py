"""Replace a loaded model's weights in place, all or nothing: RL weight syncing and reloads from a path.

Every update goes through the model's own `load_weights` (TP slicing, merged qkv / gate_up, the strict shape
checks of layers/linear.py), twice: first into a twin of the model built on the meta device, which holds no
memory and whose copies do nothing, so an unknown name or a wrong shape fails before a single weight of the
serving model changes; then into the model itself, whose parameters keep their storage (CUDA graphs and the
decode step read the same tensors afterwards).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.common.config import ModelConfig
from pagedserve.executor.model.layers.rotary import engine_max_model_len
from pagedserve.executor.model.model_loader import _DTYPES, _check_complete, _default_dtype, open_weights
from pagedserve.executor.model.models import get_model_class
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup
from pagedserve.executor.model.quant.loading import PACKED_METHODS

NamedTensors = Iterable[tuple[str, torch.Tensor]]


class WeightUpdater:
    """Updates one rank's model; built once per model (the meta twin is kept)."""

    def __init__(self, model: nn.Module, model_config: ModelConfig, tp: TPGroup, pp: PPGroup) -> None:
        self.model, self.config, self.tp, self.pp = model, model_config, tp, pp
        self._twin: nn.Module | None = None

    def _refuse_packed(self) -> None:
        method = self.config.quantization.method if self.config.quantization else None
        if method in PACKED_METHODS:
            raise ValueError(f"weight updates: a model quantized with {method!r} keeps its weights packed for its "
                             "kernels; in-place updates support unquantized models only (restart the engine to "
                             "load a new quantized checkpoint)")

    def twin(self) -> nn.Module:
        """The model built again on the meta device: the same names, shapes and loaders, no storage."""
        if self._twin is None:
            cls = get_model_class(self.config.hf_config)
            with torch.device("meta"), _default_dtype(_DTYPES[self.config.dtype]), \
                    engine_max_model_len(self.config.max_model_len):
                hf = self.config.hf_config
                self._twin = cls(hf, self.tp, self.pp) if self.pp.size > 1 else cls(hf, self.tp)
        return self._twin

    def check(self, weights: NamedTensors, complete: bool = False, source: str = "update") -> None:
        """ValueError naming the first tensor whose name the model does not know or whose shape is wrong;
        complete: every weight of the model must be present too (a reload)."""
        self._refuse_packed()
        twin = self.twin()
        loaded = twin.load_weights((name, t.to("meta")) for name, t in weights)
        if complete:
            _check_complete(twin.expected_weights() - loaded, source)

    @torch.no_grad()
    def apply(self, weights: list[tuple[str, torch.Tensor]]) -> int:
        """Check every tensor, then copy them in; returns how many were applied."""
        self.check(weights)
        self.model.load_weights(iter(weights))
        return len(weights)

    @torch.no_grad()
    def reload(self, weights_path: str | None = None) -> str:
        """Every weight again from the model's own checkpoint or another one (same architecture and shapes):
        the whole checkpoint is checked (names, shapes, completeness) before the first copy. Returns the path."""
        config = self._config_for(weights_path)
        weights, _ = open_weights(config)
        self.check(weights, complete=True, source=config.source.path)
        weights, _ = open_weights(config)
        self.model.load_weights(weights)
        return config.source.path

    def _config_for(self, weights_path: str | None) -> ModelConfig:
        if weights_path is None:
            return self.config
        from pagedserve.common.model_files import resolve_model
        source = resolve_model(weights_path)
        if source.format != self.config.source.format:
            raise ValueError(f"weights_path: a {source.format} checkpoint cannot replace a "
                             f"{self.config.source.format} one")
        return dataclasses.replace(self.config, source=source)


def describe(weights: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """A small JSON-able summary of an update, for logs and collective_rpc answers."""
    return {"tensors": len(weights), "bytes": sum(t.numel() * t.element_size() for _, t in weights)}
