"""SiLU(gate) * up over the merged gate_up projection; the element-wise activations configs name by string."""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] = [gate | up] -> [..., d]."""
        return ops.silu_and_mul(x)


def _quick_gelu(x: torch.Tensor) -> torch.Tensor:
    # The sigmoid approximation of GELU that OpenAI's CLIP was trained with (HF: "quick_gelu").
    return x * torch.sigmoid(1.702 * x)


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# HF config names (hidden_act, projector_hidden_act) -> the function.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu, "quick_gelu": _quick_gelu, "gelu_new": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh,
    "relu": F.relu, "silu": F.silu}


def get_activation(name: str, field: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """The activation a config names; ValueError naming the config field otherwise."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"{field}: {name!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
    return _ACTIVATIONS[name]
