"""A worker extension for the tests (worker_extension_cls="pagedserve.tests.helpers.rl.rl_extension.Probe"): its
methods join the worker's and collective_rpc reaches them on every rank."""
from __future__ import annotations

import hashlib
import os
from typing import Any

import torch
from safetensors.torch import load_file

BAD_SHAPE = "model.layers.1.mlp.down_proj.weight"      # [64, 128] in the tiny model, given as [64, 136]
UNKNOWN = "model.layers.1.mlp.surprise.weight"


def checkpoint_batch(path: str, change: str | None = None) -> list[tuple[str, torch.Tensor]]:
    """A tiny checkpoint's tensors in name order; change "shape": BAD_SHAPE moved last and 8 columns wider,
    "name": an UNKNOWN tensor last. Every tensor before the bad one is valid, so a loader that copies as it
    goes has changed most of the model by the time it refuses."""
    tensors = sorted(load_file(os.path.join(path, "model.safetensors")).items())
    if change == "shape":
        t = dict(tensors)[BAD_SHAPE]
        return [(n, x) for n, x in tensors if n != BAD_SHAPE] + [(BAD_SHAPE, torch.cat((t, t[:, :8]), 1))]
    if change == "name":
        return tensors + [(UNKNOWN, torch.zeros(64, 64))]
    if change is not None:
        raise ValueError(f"change must be None, 'shape' or 'name', got {change!r}")
    return tensors


def weights_digest(model: torch.nn.Module) -> str:
    """A hash of every weight's name and bytes: equal digests, bitwise equal weights."""
    h = hashlib.sha256()
    for name, p in sorted(model.named_parameters(), key=lambda item: item[0]):
        h.update(name.encode())
        h.update(p.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


class Probe:
    def describe_rank(self, tag: str = "") -> dict[str, Any]:
        """Which rank answered, its tensor-parallel slice of one weight, and the caller's tag back."""
        qkv = self.runner.model.model.layers[0].self_attn.qkv_proj.weight
        return {"rank": self.rank, "tp_rank": self.tp.rank, "rows": qkv.shape[0], "tag": tag}

    def weight_tensor(self) -> Any:
        """A tensor: not JSON-able, so collective_rpc refuses to send it back."""
        return self.runner.model.model.norm.weight

    def load_checkpoint_weights(self, path: str, change: str | None = None) -> int:
        """`model.load_weights(weights=...)` as TRL's, OpenRLHF's and verl's extensions call it, with path's
        tensors from a generator (read once); how many checkpoint names the model loaded."""
        batch = (item for item in checkpoint_batch(path, change))
        return len(self.runner.model.load_weights(weights=batch))

    def update_checkpoint_weights(self, path: str, change: str | None = None) -> int:
        """The same batch through the worker's own in-process entry point, `self.update_weights`."""
        return self.update_weights(checkpoint_batch(path, change))

    def rank_weights_digest(self) -> str:
        return weights_digest(self.runner.model)


class PathProbe(Probe):
    def batch_invariant_path(self) -> dict[str, Any]:
        """The kernels this rank's model runs (--batch-invariant picks them): its attention backend and the
        method of its first dense linear."""
        qkv = self.runner.model.model.layers[0].self_attn.qkv_proj
        return {"attention": self.runner.attn_backend.name, "linear": qkv.method.name,
                "config": self.runner.config.model.batch_invariant}
