"""The loader checks every checkpoint tensor's whole shape before a rank takes its slice (issue 30): a wider
tensor used to be narrowed to fit and load without a word."""
from __future__ import annotations

import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.parity import model_config
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model


def _widen(folder: str, name: str, dim: int, extra: int) -> None:
    """Rewrite the checkpoint with `name` grown by `extra` along `dim` (random values)."""
    path = os.path.join(folder, "model.safetensors")
    tensors = load_file(path)
    shape = list(tensors[name].shape)
    shape[dim] = extra
    tensors[name] = torch.cat((tensors[name], torch.randn(shape)), dim)
    save_file(tensors, path, metadata={"format": "pt"})


# (checkpoint tensor, dim widened): a row-parallel input dim, a merged (gate_up) and a qkv part's rows, a norm.
CASES = [("model.layers.0.mlp.down_proj.weight", 1), ("model.layers.1.mlp.up_proj.weight", 0),
         ("model.layers.0.self_attn.k_proj.weight", 0), ("model.layers.0.self_attn.o_proj.weight", 1),
         ("model.norm.weight", 0)]


@pytest.mark.parametrize("name,dim", CASES)
def test_wider_tensor_is_refused_with_both_shapes(tmp_path, name: str, dim: int) -> None:
    folder = make_tiny_model(str(tmp_path / "m"), intermediate_size=128)
    _widen(folder, name, dim, 8)
    with pytest.raises(ValueError) as err:
        load_model(model_config(folder), TPGroup(rank=0, size=1))
    message = str(err.value)
    assert name in message, message
    wanted = list(load_file(os.path.join(folder, "model.safetensors"))[name].shape)
    wanted[dim] -= 8
    assert str(tuple(wanted)) in message and str(tuple(wanted[:dim] + [wanted[dim] + 8] + wanted[dim + 1:])) \
        in message, message


def test_down_proj_of_the_issue_at_tp2_rank(tmp_path) -> None:
    """[128, 264] for [128, 256] (hidden 128, intermediate 256): rank 1 of 2 would take columns 128..256."""
    folder = make_tiny_model(str(tmp_path / "m"), hidden_size=128, intermediate_size=256)
    _widen(folder, "model.layers.1.mlp.down_proj.weight", 1, 8)
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*\(128, 264\).*\(128, 256\)"):
        load_model(model_config(folder), TPGroup(rank=1, size=2))
