"""Which form torch's CPU int4 pack takes in this process, and reading channels out of it.

`torch._convert_weight_to_int4pack_for_cpu` lays the codes out for the CPU dispatch torch runs (aten's
`weight_to_int4pack_kernel`): AVX-512 machines get blocks of 64 output channels, AVX2 and plain ones blocks of
32, paired differently (kernels/cpu/csrc/gemv.h draws all three). Our kernels read the same bytes torch's own
kernel reads, so they must be told the form: reading an AVX2 pack as the AVX-512 one gives wrong weights,
silently. The form is found by packing a known pattern once, not guessed from CPU flags, so an
`ATEN_CPU_CAPABILITY` override or a new dispatch is read as what it writes.
"""
from __future__ import annotations

import functools

import torch

# gemv.h's PACK_*: the vector kernels (AVX-512 GEMV, VNNI/AMX GEMMs, the C decode step) read PACK_AVX512 alone.
PACK_AVX512, PACK_AVX2, PACK_PLAIN = 0, 1, 2
_BLOCK = {PACK_AVX512: 64, PACK_AVX2: 32, PACK_PLAIN: 32}


def pack_codes(q: torch.Tensor, layout: int) -> torch.Tensor:
    """codes q [n, k] (0..15, n a multiple of 64) packed as form `layout`: uint8 [n, k / 2], torch's bytes."""
    n, k = q.shape
    block = _BLOCK[layout]
    blocks = q.to(torch.uint8).view(n // block, block, k).transpose(1, 2)            # [n / block, k, block]
    if layout == PACK_PLAIN:
        low, high = blocks[..., 0::2], blocks[..., 1::2]
    else:
        low, high = blocks[..., :block // 2], blocks[..., block // 2:]
    return (low | (high << 4)).contiguous().view(n, k // 2)


@functools.lru_cache(maxsize=1)
def pack_layout() -> int:
    """The form this process's torch writes (and its int4 kernel reads)."""
    n, k = 64, 2
    channel = torch.arange(n, dtype=torch.int32)
    q = torch.stack((channel % 16, channel // 16), 1)                           # each channel's codes differ
    packed = torch._convert_weight_to_int4pack_for_cpu(q.contiguous(), 2).view(n, k // 2)
    for layout in (PACK_AVX512, PACK_AVX2, PACK_PLAIN):
        if torch.equal(packed, pack_codes(q, layout)):
            return layout
    raise RuntimeError("torch's CPU int4 pack has a form the kernels do not know (kernels/cpu/int4_pack.py)")


def channel_codes(packed: torch.Tensor, k: int, channels: torch.Tensor, layout: int) -> torch.Tensor:
    """The codes of output channels `channels` [t] over all k input columns: int32 [t, k]."""
    block = _BLOCK[layout]
    half = block // 2
    within = channels % block
    if layout == PACK_PLAIN:
        byte_of, shift = within // 2, (within % 2) * 4
    else:
        byte_of, shift = within % half, (within // half) * 4
    blocks = packed.reshape(-1, k, half).index_select(0, channels // block)         # [t, k, half]
    byte = blocks.gather(2, byte_of.view(-1, 1, 1).expand(-1, k, 1)).squeeze(2).to(torch.int32)
    return (byte >> shift.view(-1, 1).to(torch.int32)) & 15
