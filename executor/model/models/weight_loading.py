"""`load_weights`, all or nothing, for every model class: the call a worker extension makes
(`self.runner.model.load_weights(weights=[(name, tensor), ...])`, as TRL's, OpenRLHF's and verl's do in vLLM)
leaves the model as it was when any tensor of the batch is refused.

A model class writes `stream_weights`: each checkpoint tensor copied into its (merged, sharded) parameter as it
comes, nothing looked ahead. The first load streams a checkpoint that way (it may be larger than memory, and a
failure there discards the model), and so does an update once checked (executor/worker/rl/model_update.py).
`LoadableModel.load_weights`, the only one, reads the batch once into a list and first runs it through the
`stream_weights` of a twin of the model built on the meta device: the same names, shapes and loaders, no
storage, copies that do nothing. An unknown name or a wrong shape fails there, naming the tensor, before a
single weight of the model changes; then the batch streams into the model.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.quant.loading import begin_packed_update, end_packed_update

NamedTensors = Iterable[tuple[str, Any]]


class _Span:
    """A piece's rows without its values: a twin collecting pieces keeps only these."""

    def __init__(self, rows: int) -> None:
        self.shape = (rows,)


class RowsOnly(list):
    """A quantized layer's piece list on the twin (begin_packed_update): rows kept, values dropped."""

    def append(self, piece: tuple[int, Any]) -> None:
        row, src = piece
        super().append((row, _Span(src.shape[0])))


def on_meta(weights: NamedTensors) -> Iterator[tuple[str, Any]]:
    """The tensors as the twin takes them: their shapes and dtypes, no data (a GroupQuantWeight passes as it
    is; the twin keeps only its rows, RowsOnly)."""
    for name, t in weights:
        yield name, t.to("meta") if isinstance(t, torch.Tensor) else t


class LastName:
    """The batch tensor last handed to the loader: where the loader renames (GGUF, Phi-3's fused q/k/v, a MoE
    block) or combines (AWQ/GPTQ) tensors, its errors name the tensor as the caller named it too."""

    def __init__(self, weights: NamedTensors) -> None:
        self.weights, self.name = weights, None

    def __iter__(self) -> Iterator[tuple[str, Any]]:
        for name, t in self.weights:
            self.name = name
            yield name, t
        self.name = None            # a check after the last tensor names what it found itself

    def named(self, exc: ValueError) -> ValueError:
        if self.name is None or self.name in str(exc):
            return exc
        return ValueError(f"{exc} (update tensor {self.name!r})")


def _collecting(model: nn.Module) -> bool:
    """Whether the model's quantized layers collect pieces (a first load of a quantized model in progress)."""
    return any(getattr(m, "_pieces", None) is not None for m in model.modules())


def _packed(model: nn.Module) -> bool:
    return any(getattr(m, "packed", None) is not None for m in model.modules())


class LoadableModel(nn.Module):
    """Base of every model class. Subclasses implement stream_weights (and expected_weights); load_weights is
    this class's alone, so no model can skip the check."""

    def __new__(cls, *args: Any, **kwargs: Any) -> LoadableModel:
        model = super().__new__(cls)
        # The twin is built as the caller built this model: a subclass's constructor may differ from its base's.
        object.__setattr__(model, "_build_args", (args, kwargs))
        return model

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if cls.load_weights is not LoadableModel.load_weights:
            raise TypeError(f"{cls.__name__} overrides load_weights: implement stream_weights instead (load_weights "
                            "checks the whole batch before any copy)")

    def stream_weights(self, weights: NamedTensors) -> set[str]:
        """Copy each HF-named tensor into its parameter as it comes; the checkpoint names consumed, comparable
        with expected_weights(). ValueError naming a tensor the model has no parameter for or of a wrong shape
        (the tensors before it are copied already: load_weights checks first)."""
        raise NotImplementedError

    @torch.no_grad()
    def load_weights(self, weights: NamedTensors) -> set[str]:
        """Every tensor's name and shape checked, then all copied in; ValueError naming the first bad tensor,
        and then no weight has changed. weights may be a generator: it is read once."""
        batch = list(weights)
        self.check_weights(batch)
        return self.stream_weights(batch)

    def check_weights(self, batch: list[tuple[str, Any]]) -> None:
        """The batch through the meta twin's stream_weights: what it refuses, the model would refuse part-way."""
        collecting = _collecting(self)
        if not collecting and _packed(self):
            raise ValueError("load_weights: this model's weights are quantized (packed for their kernels); update "
                             "them with the worker's update_weights(weights), which a worker extension calls as "
                             "self.update_weights([...]), with tensors named and stored as its checkpoint holds "
                             "them (docs/rl_weight_updates.md)")
        twin, names = self.meta_twin(), LastName(batch)
        if collecting:          # the twin takes quantized pieces as the model's layers do: collected, not copied
            begin_packed_update(twin, RowsOnly)
        try:
            twin.stream_weights(on_meta(names))
        except ValueError as exc:
            raise names.named(exc) from exc
        finally:
            if collecting:
                end_packed_update(twin)

    def meta_twin(self) -> LoadableModel:
        """This model built again on the meta device (kept): its names, shapes and loaders, no storage."""
        twin = self.__dict__.get("_meta_twin")
        if twin is None:
            args, kwargs = self.__dict__["_build_args"]
            with torch.device("meta"):
                twin = type(self)(*args, **kwargs)
            object.__setattr__(self, "_meta_twin", twin)    # not a submodule: no parameters of the model's
        return twin
