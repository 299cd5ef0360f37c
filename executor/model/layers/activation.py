"""SiLU(gate) * up over the merged gate_up projection."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import ops


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] = [gate | up] -> [..., d]."""
        return ops.silu_and_mul(x)
