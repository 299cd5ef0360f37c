"""Mixture-of-experts in PyTorch: the router's top-k and a grouped expert MLP that computes only the chosen experts.

The CPU path and the oracle for kernels/triton/moe.py. Expert weights are stacked: w13 [E, 2*I, H] holds each
expert's gate rows then up rows, w2 [E, H, I] its down projection (HF's own stacked layout).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def topk_softmax(router_logits: torch.Tensor, top_k: int, renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64).

    Softmax over all experts in float32, then the top k; `renormalize` rescales the k weights to sum to 1
    (Mixtral, Qwen3-MoE with norm_topk_prob), otherwise they stay the full softmax's (Qwen2-MoE).
    """
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def sort_by_expert(topk_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, list[int]]:
    """(order of the flattened [T*k] assignments grouped by expert, tokens per expert).

    Stable, so each expert's tokens keep their batch order.
    """
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return order, counts


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor) -> torch.Tensor:
    """sum_j topk_weights[t, j] * expert_{topk_ids[t, j]}(x[t]) for x [T, H]; returns [T, H] in x's dtype.

    Tokens are sorted by expert and each expert that received any runs one GEMM pair over its rows, so the
    work is T*k rows whatever the number of experts.
    """
    tokens, top_k = topk_ids.shape
    out = torch.zeros_like(x)
    if tokens == 0:
        return out
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        return masked_moe(x, w13, w2, topk_weights, topk_ids)
    order, counts = sort_by_expert(topk_ids, w13.shape[0])
    token_of = order // top_k                              # source row of each sorted assignment
    rows = x.index_select(0, token_of)
    expert_out = torch.empty_like(rows)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        end = start + count
        gate_up = F.linear(rows[start:end], w13[expert])
        half = gate_up.shape[-1] // 2
        expert_out[start:end] = F.linear(F.silu(gate_up[:, :half]) * gate_up[:, half:], w2[expert])
        start = end
    weights = topk_weights.reshape(-1).index_select(0, order).to(x.dtype)
    out.index_add_(0, token_of, expert_out * weights[:, None])
    return out


def masked_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
               topk_ids: torch.Tensor) -> torch.Tensor:
    """Every expert over every token, weighted by the routing (zero where not chosen): E times the work, but no
    data-dependent shapes, so it can be captured in a CUDA graph (PAGEDSERVE_KERNELS=torch on a GPU)."""
    out = torch.zeros_like(x)
    for expert in range(w13.shape[0]):
        weight = (topk_weights * (topk_ids == expert)).sum(dim=-1).to(x.dtype)      # [T]
        gate_up = F.linear(x, w13[expert])
        half = gate_up.shape[-1] // 2
        out += F.linear(F.silu(gate_up[:, :half]) * gate_up[:, half:], w2[expert]) * weight[:, None]
    return out
