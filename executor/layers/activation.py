"""SiLU(gate) * up over the merged gate_up projection."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., 2 * d] = [gate | up] -> [..., d]."""
        half = x.shape[-1] // 2
        return F.silu(x[..., :half]) * x[..., half:]
