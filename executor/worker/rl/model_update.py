"""Replace a loaded model's weights in place, all or nothing: RL weight syncing and reloads from a path.

Every update goes through the model's own `stream_weights` (TP slicing, merged qkv / gate_up, the strict shape
checks of layers/linear.py), twice: first into the model's twin on the meta device (LoadableModel.meta_twin,
the one `model.load_weights` checks a batch on too), which holds no memory and whose copies do nothing, so an
unknown name or a wrong shape fails before a single weight of the serving model changes; then into the model
itself, whose parameters keep their storage (CUDA graphs and the decode step read the same tensors afterwards).

A quantized model's update is named and stored as its checkpoint is (GGUF names and blocks, AWQ/GPTQ parts,
float tensors for quantization at load) and goes through the loader's own mapping of that checkpoint
(model_loader.update_weights_stream) and its packing (quant/loading.py, quant/packing.py): the layers collect
the pieces while their packed weights keep serving, then pack them with the first load's rules. A packed
weight that comes out in the same form and shapes is copied into the old one's storage; one whose form
changed (a GGUF tensor in another format) is replaced, and `relinked` tells the caller to rebind what holds
the old addresses (the C decode step, CUDA graphs).
"""
from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from typing import Any

import torch

from pagedserve.common.config.engine_args import ModelConfig
from pagedserve.executor.model.layers.linear_method import use_batch_invariant_methods
from pagedserve.executor.model.model_loader import _DTYPES, _check_complete, open_weights, update_weights_stream
from pagedserve.executor.model.models.weight_loading import LastName, LoadableModel, NamedTensors, RowsOnly, on_meta
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup
from pagedserve.executor.model.quant.loading import (PACKED_METHODS, begin_packed_update, check_update_pieces,
                                                     end_packed_update, finish_packed)


def nbytes(t: Any) -> int:
    """Bytes of an update's tensor (a torch tensor or gguf_blocks.GGUFBlocks)."""
    return t.nbytes if not isinstance(t, torch.Tensor) else t.numel() * t.element_size()


class WeightUpdater:
    """Updates one rank's model; built once per model (the meta twin is kept)."""

    def __init__(self, model: LoadableModel, model_config: ModelConfig, tp: TPGroup, pp: PPGroup) -> None:
        self.model, self.config, self.tp, self.pp = model, model_config, tp, pp
        method = model_config.quantization.method if model_config.quantization else None
        self.packed_method = method if method in PACKED_METHODS else None
        self.relinked = False     # some packed weight was replaced by new tensors since the caller last looked

    def twin(self) -> LoadableModel:
        """The model built again on the meta device: the same names, shapes and loaders, no storage."""
        return self.model.meta_twin()

    def _stream(self, weights: NamedTensors) -> Iterable[tuple[str, Any]]:
        """An update's tensors as stream_weights takes them: an unquantized model's are its checkpoint's already."""
        return weights if self.packed_method is None else update_weights_stream(self.config, weights)

    def check(self, weights: NamedTensors, complete: bool = False, source: str = "update") -> None:
        """ValueError naming the first tensor whose name the model does not know or whose shape is wrong (or,
        quantized, a layer the update fills only in part); complete: every weight of the model must be
        present too (a reload). weights: stream_weights's stream (see _stream)."""
        twin = self.twin()
        if self.packed_method is not None:
            begin_packed_update(twin, RowsOnly)
        try:
            loaded = twin.stream_weights(on_meta(weights))
            if self.packed_method is not None:
                check_update_pieces(twin)
        finally:
            end_packed_update(twin)
        if complete:
            _check_complete(twin.expected_weights() - loaded, source)

    @torch.no_grad()
    def apply(self, weights: list[tuple[str, Any]]) -> int:
        """Check every tensor, then copy them in; returns how many were applied."""
        names = LastName(weights)
        try:
            self.check(self._stream(names))
        except ValueError as exc:
            raise names.named(exc) from exc
        self._load(self._stream(weights))
        return len(weights)

    @torch.no_grad()
    def reload(self, weights_path: str | None = None) -> str:
        """Every weight again from the model's own checkpoint or another one (same architecture and shapes):
        the whole checkpoint is checked (names, shapes, completeness) before the first copy. Returns the path."""
        config = self._config_for(weights_path)
        weights, _ = open_weights(config)
        self.check(weights, complete=True, source=config.source.path)
        weights, _ = open_weights(config)
        self._load(weights)
        return config.source.path

    def _load(self, weights: Iterable[tuple[str, Any]]) -> None:
        # stream_weights: the batch is checked already (load_weights would check it again)
        if self.packed_method is None:
            self.model.stream_weights(weights)
            return
        begin_packed_update(self.model)
        try:
            self.model.stream_weights(weights)
        except BaseException:
            end_packed_update(self.model)
            raise
        device = torch.device(self.config.device)
        self.relinked |= finish_packed(self.model, self.packed_method, device, _DTYPES[self.config.dtype])
        if self.config.batch_invariant:     # packing picked the layers' methods again
            use_batch_invariant_methods(self.model)

    def take_relinked(self) -> bool:
        """Whether some packed weight got new tensors since the last call (then their addresses changed)."""
        relinked, self.relinked = self.relinked, False
        return relinked

    def _config_for(self, weights_path: str | None) -> ModelConfig:
        if weights_path is None:
            return self.config
        from pagedserve.common.model.model_files import resolve_model
        source = resolve_model(weights_path)
        if source.format != self.config.source.format:
            raise ValueError(f"weights_path: a {source.format} checkpoint cannot replace a "
                             f"{self.config.source.format} one")
        return dataclasses.replace(self.config, source=source)


def describe(weights: list[tuple[str, Any]]) -> dict[str, Any]:
    """A small JSON-able summary of an update, for logs and collective_rpc answers."""
    return {"tensors": len(weights), "bytes": sum(nbytes(t) for _, t in weights)}
