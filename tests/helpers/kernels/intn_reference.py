"""The 5/6-bit pack (kernels/weights/weight_intn.py) read back in PyTorch: the reference the tests hold the C kernels
and the pack to."""
from __future__ import annotations

import torch

from pagedserve.kernels.weights.weight_intn import IntNWeight


def intn_dequantize(w: IntNWeight) -> torch.Tensor:
    """The float32 weight [out, in]: codes from the nibbles and bit planes (gemm_intn.h), times the scales,
    plus the zeros."""
    out, cols, g = w.out_features, w.in_features, w.group_size
    rec = w.packed.to(torch.int32)
    nib = rec[..., :64].reshape(out // 64, cols, 32).transpose(1, 2)            # [blocks, 32, in]
    q = torch.cat((nib & 15, nib >> 4), 1).reshape(out, cols)
    for b in range(w.bits - 4):
        words = rec[..., 64 + 16 * b:80 + 16 * b].reshape(out // 64, cols // 2, 4, 4, 1)
        bits = (words >> torch.arange(8, dtype=torch.int32)) & 1                  # [blocks, pairs, c, byte, bit]
        bit = bits.reshape(out // 64, cols // 2, 4, 16, 2).permute(0, 2, 3, 1, 4).reshape(out, cols)
        q = q | (bit << (4 + b))
    sz = w.scales_and_zeros.float().transpose(0, 1)                             # [out, groups, 1 | 2]
    wf = (q.float() - (1 << (w.bits - 1))) * sz[..., 0].repeat_interleave(g, 1)
    return wf + sz[..., 1].repeat_interleave(g, 1) if sz.shape[-1] == 2 else wf
