"""Float linears whose every row's bits are independent of the rows beside it (VLLM_BATCH_INVARIANT=1).

torch's CPU matmul (MKL / oneDNN) picks its kernel and blocking by the number of rows: a row's result differs
between a call of 1, 2-3, 4-16 and 17+ rows (docs/determinism.md, checked on 576x576 .. 49152x576). At one fixed
row count it does not: a row gets the same bits at any position in the block beside any other rows. So every
call runs in blocks of exactly FIXED_ROWS rows, the last one padded with zeros. A decode's one row then costs a
16-row GEMM, and a prompt chunk 16-row GEMMs in a loop; hence a switch, off by default.
"""
from __future__ import annotations

import torch

FIXED_ROWS = 16


def fixed_rows_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), FIXED_ROWS rows a call."""
    x2 = x.reshape(-1, x.shape[-1])
    rows = x2.shape[0]
    pad = -rows % FIXED_ROWS
    if pad:
        x2 = torch.cat((x2, x2.new_zeros(pad, x2.shape[1])))
    y = torch.empty(x2.shape[0], weight.shape[0], dtype=torch.promote_types(x2.dtype, weight.dtype))
    w_t = weight.t()
    for a in range(0, x2.shape[0], FIXED_ROWS):
        torch.mm(x2[a:a + FIXED_ROWS], w_t, out=y[a:a + FIXED_ROWS])
    y = y[:rows].reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias
