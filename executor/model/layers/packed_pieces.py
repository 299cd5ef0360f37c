"""Collecting a quantized layer's checkpoint pieces and installing their packed form.

A layer whose weight may be packed for a weight-only kernel (linear layers, the vocabulary embedding and
LM head) collects the checkpoint slices its rank owns ("pieces") instead of copying them into a dense
weight, then packs them at the end of a load or a weight update. The collecting and the swap of the packed
form are the same for every such layer; how the pieces are packed (pack_linear, pack_embedding) is the
layer's own.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.executor.model.quant.packing import Packed, Piece, copy_into_form


class PackedPieces:
    """Mixin for an nn.Module with `weight`, `packed`, `_pieces` (None when not collecting) and a
    `weight_loader(param, loaded_weight, shard_id=None)` that appends to `_pieces` while they are collected."""

    weight: nn.Parameter
    packed: Packed | None
    _pieces: list[Piece] | None

    def weight_loader(self, param: nn.Parameter, loaded_weight, shard_id: int | str | None = None) -> None:
        raise NotImplementedError

    def _loadable(self, weight: torch.Tensor) -> nn.Parameter:
        param = nn.Parameter(weight, requires_grad=False)
        param.weight_loader = self.weight_loader
        return param

    def begin_packed_load(self) -> None:
        """Collect the weight's pieces instead of copying them; the dense weight is never filled."""
        if self._pieces is not None:
            return
        self.weight, self._pieces = self._loadable(torch.empty(0)), []

    def begin_packed_update(self, pieces: list | None = None) -> None:
        """Collect an update's pieces (into `pieces` when given) while the current weight keeps serving."""
        self._pieces = [] if pieces is None else pieces

    def take_pieces(self) -> list[Piece]:
        pieces, self._pieces = self._pieces or [], None
        return pieces

    def _install_form(self, packed: Packed, device: torch.device) -> bool:
        """Copy a packed weight into the current one where it has the same form and shapes (its storage stays,
        for CUDA graphs and the C decode step), else put it in its place (returns True)."""
        if copy_into_form(self.weight if self.packed is None else self.packed, packed):
            return False
        if isinstance(packed, torch.Tensor):      # dense after all (e.g. an F16 tensor in a GGUF file)
            self.weight, self.packed = self._loadable(packed), None
        else:
            self.weight, self.packed = self._loadable(torch.empty(0, device=device)), packed
        return True
