"""LoRA's per-token delta on CPU through the C kernel (kernels/cpu/csrc/lora.c): one call per linear layer for the
decode rows of several adapters, where torch needed five ops. Same contract as kernels/triton/lora.py, with B
kept transposed (the pool's layout, executor/model/layers/lora.py)."""
from __future__ import annotations

import torch

from pagedserve.kernels.cpu.native import check, library, threads_for

_MAX_WIDTH = 1024           # lora.c's LORA_MAX_WIDTH
_WEIGHT_DTYPES = (torch.float32, torch.bfloat16)     # the pool's dtypes lora.c reads (lora.h)


def available(width: int) -> bool:
    """Whether lora_bgmv takes slots of this width (pieces * rank) on this machine."""
    return library() is not None and width <= _MAX_WIDTH


def lora_bgmv(x: torch.Tensor, a: torch.Tensor, b_t: torch.Tensor, token_slots: torch.Tensor, order: torch.Tensor,
              widths: torch.Tensor, bounds: torch.Tensor, y: torch.Tensor) -> bool:
    """y[t] += (x[t] A[s]^T) B[s] for the tokens t of `order` (int32, sorted by slot), s = token_slots[t], in
    place; a [slots, w, in], b_t [slots, w, out] (float32 or bfloat16), B's pieces by their output columns
    (bounds: int64 [pieces + 1]); x and y float32. False (nothing done) where the C kernels are not built or the tensors are not float32
    [tokens, features] rows (the caller's torch path then)."""
    lib = library()
    if (lib is None or x.dtype != torch.float32 or y.dtype != torch.float32 or a.dtype not in _WEIGHT_DTYPES
            or b_t.dtype != a.dtype or x.dim() != 2 or not (x.is_contiguous() and y.is_contiguous())
            or a.shape[1] > _MAX_WIDTH):
        return False
    count, width = order.numel(), a.shape[1]
    threads = threads_for(count * width * (x.shape[1] + y.shape[1]), 1 << 18)
    check(lib.ps_lora_bgmv(x.data_ptr(), a.data_ptr(), b_t.data_ptr(), int(a.dtype == torch.bfloat16),
                           order.data_ptr(), count,
                           token_slots.data_ptr(), widths.data_ptr(), bounds.data_ptr(), bounds.numel() - 1,
                           y.data_ptr(), x.shape[1], y.shape[1], width, threads), "LoRA delta")
    return True
