"""Fused mixture-of-experts on the GPU: a grouped GEMM over token assignments sorted by expert.

Each of the T*k (token, expert) assignments is placed in its expert's segment of a padded list in which
every expert's segment is a whole number of BLOCK_M rows (`align_block_size`); so every BLOCK_M tile of rows
belongs to one expert, and a program multiplies its tile by that expert's weights only. Two launches:
x @ w13[e]^T -> SiLU(gate) * up -> @ w2[e]^T scaled by the routing weight; the k rows of each token are then
summed. The alignment is built on the device with shapes fixed by T, E and BLOCK_M (no host sync), so a
decode step can be captured in a CUDA graph. Same contract as kernels/torch_moe.fused_moe.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedserve.kernels.triton import fused as triton_fused


def align_block_size(topk_ids: torch.Tensor, num_experts: int,
                     block_m: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted assignment ids, expert of each BLOCK_M tile, number of rows used) for topk_ids [T, k].

    sorted ids [T*k + E*(block_m-1)]: assignment indices t*k + j grouped by expert, each group padded to a
    multiple of block_m with T*k (an invalid id). Tiles past the used rows get expert id num_experts.
    """
    flat = topk_ids.reshape(-1).to(torch.int64)
    assignments = flat.numel()
    max_rows = assignments + num_experts * (block_m - 1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))           # bincount without a host sync
    padded = (counts + block_m - 1) // block_m * block_m
    padded_end = torch.cumsum(padded, 0)
    padded_start, start = padded_end - padded, torch.cumsum(counts, 0) - counts
    order = torch.argsort(flat, stable=True)
    expert_of = flat[order]
    rank_in_expert = torch.arange(assignments, device=flat.device) - start[expert_of]
    sorted_ids = torch.full((max_rows,), assignments, dtype=torch.int32, device=flat.device)
    sorted_ids[padded_start[expert_of] + rank_in_expert] = order.to(torch.int32)
    tile_starts = torch.arange(0, max_rows, block_m, device=flat.device)
    tile_expert = torch.searchsorted(padded_end, tile_starts, right=True).to(torch.int32)
    return sorted_ids, tile_expert, padded_end[-1:].to(torch.int32)


@triton.jit
def _moe_gemm_kernel(a_ptr, b_ptr, c_ptr, weights_ptr, sorted_ids_ptr, tile_expert_ptr, rows_used_ptr,
                     N, K, num_assignments, stride_am, stride_be, stride_bn, stride_cm,
                     A_ROWS_PER: tl.constexpr, MUL_WEIGHT: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[id] = A[id // A_ROWS_PER] @ B[expert]^T (* weight[id]) for the BLOCK_M ids of this tile."""
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    if pid_m * BLOCK_M >= tl.load(rows_used_ptr):
        return
    ids = tl.load(sorted_ids_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    valid = ids < num_assignments
    expert = tl.load(tile_expert_ptr + pid_m).to(tl.int64)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_rows = a_ptr + (ids // A_ROWS_PER)[:, None] * stride_am
    b_cols = b_ptr + expert * stride_be + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + ks) < K
        a = tl.load(a_rows + (k0 + ks)[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
        b = tl.load(b_cols + (k0 + ks)[:, None], mask=k_ok[:, None] & col_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, b, input_precision="ieee")
        else:
            acc += tl.dot(a, b)
    if MUL_WEIGHT:
        acc = acc * tl.load(weights_ptr + ids, mask=valid, other=0.0)[:, None]
    tl.store(c_ptr + ids[:, None] * stride_cm + cols[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=valid[:, None] & col_ok[None, :])


def _block_m(assignments: int, num_experts: int) -> int:
    # Few rows per expert (decode): small tiles waste less padding; tl.dot needs at least 16.
    return 16 if assignments <= 4 * num_experts * 16 else 64


def _grouped_gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, weights: torch.Tensor | None,
                  align: tuple[torch.Tensor, torch.Tensor, torch.Tensor], a_rows_per: int, block_m: int) -> None:
    sorted_ids, tile_expert, rows_used = align
    n, k = b.shape[1], b.shape[2]
    tiles = tile_expert.numel()
    # At most one tile per assignment is non-empty: with fewer assignments than tiles, launch only that many.
    tiles = min(tiles, out.shape[0])
    block_n, block_k = 64, 32 if k <= 64 else 64
    grid = (tiles, triton.cdiv(n, block_n))
    _moe_gemm_kernel[grid](a, b, out, weights if weights is not None else out, sorted_ids, tile_expert, rows_used,
                           n, k, out.shape[0], a.stride(0), b.stride(0), b.stride(1), out.stride(0),
                           A_ROWS_PER=a_rows_per, MUL_WEIGHT=weights is not None,
                           IEEE=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                           num_warps=4)


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, block_m: int | None = None) -> torch.Tensor:
    """x [T, H], w13 [E, 2I, H], w2 [E, H, I], topk_* [T, k] -> [T, H] (see torch_moe.fused_moe)."""
    tokens, top_k = topk_ids.shape
    num_experts, hidden = w13.shape[0], x.shape[1]
    if tokens == 0:
        return torch.zeros_like(x)
    x, w13, w2 = x.contiguous(), w13.contiguous(), w2.contiguous()
    assignments = tokens * top_k
    block_m = block_m or _block_m(assignments, num_experts)
    align = align_block_size(topk_ids, num_experts, block_m)
    gate_up = torch.empty(assignments, w13.shape[1], dtype=x.dtype, device=x.device)
    _grouped_gemm(x, w13, gate_up, None, align, top_k, block_m)
    act = triton_fused.silu_and_mul(gate_up)
    down = torch.empty(assignments, hidden, dtype=x.dtype, device=x.device)
    weights = topk_weights.reshape(-1).to(torch.float32).contiguous()
    _grouped_gemm(act, w2, down, weights, align, 1, block_m)
    return down.view(tokens, top_k, hidden).sum(dim=1)
