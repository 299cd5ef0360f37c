"""RMSNorm with an optional fused residual add (computed in float32, as transformers does)."""
from __future__ import annotations

import torch
from torch import nn

from pagedserve.kernels import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor,
                residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """norm(x), or with a residual: (norm(x + residual), x + residual), the new residual stream."""
        return ops.rms_norm(x, self.weight, self.eps, residual)
