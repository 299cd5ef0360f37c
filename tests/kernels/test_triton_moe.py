"""The fused-MoE Triton kernel against the grouped PyTorch reference (CPU: TRITON_INTERPRET=1, tiny shapes)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before the kernel modules are imported: @triton.jit reads it at decoration time.
    os.environ.setdefault("TRITON_INTERPRET", "1")
triton = pytest.importorskip("triton")

from pagedserve.kernels import torch_moe
from pagedserve.kernels.triton import moe as triton_moe  # noqa: E402
from pagedserve.tests.helpers.kernels.kernel_checks import DEVICE, rel_err  # noqa: E402


def moe_case(tokens: int, hidden: int, inter: int, experts: int, top_k: int, seed: int, skewed: bool = False):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5
    w2 = torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5
    logits = torch.randn(tokens, experts, generator=gen)
    if skewed:                     # most tokens to expert 0, some experts get none
        logits[:, 0] += 4.0
        logits[:, experts // 2:] -= 8.0
    weights, ids = torch_moe.topk_softmax(logits, top_k, renormalize=True)
    return x, w13, w2, weights, ids


@pytest.mark.parametrize("tokens,experts,top_k,block_m", [(1, 4, 2, 16), (5, 6, 2, 16), (37, 4, 2, 16),
                                                          (40, 8, 3, 32)])
def test_align_block_size_pads_each_expert_to_whole_tiles(tokens, experts, top_k, block_m):
    _, _, _, _, ids = moe_case(tokens, 8, 8, experts, top_k, seed=tokens)
    sorted_ids, tile_expert, rows_used = triton_moe.align_block_size(ids, experts, block_m)
    flat, used = ids.reshape(-1), int(rows_used)
    assert used % block_m == 0 and sorted_ids.numel() == flat.numel() + experts * (block_m - 1)
    real = sorted_ids[:used][sorted_ids[:used] < flat.numel()].long()
    assert sorted(real.tolist()) == list(range(flat.numel()))              # every assignment exactly once
    assert bool((sorted_ids[used:] == flat.numel()).all())
    for tile in range(used // block_m):
        rows = sorted_ids[tile * block_m:(tile + 1) * block_m].long()
        rows = rows[rows < flat.numel()]
        assert rows.numel() > 0 and bool((flat[rows] == tile_expert[tile]).all())
    counts = torch.bincount(flat, minlength=experts)
    assert used == int(((counts + block_m - 1) // block_m * block_m).sum())


@pytest.mark.parametrize("tokens,hidden,inter,experts,top_k,skewed,block_m", [
    (1, 32, 16, 4, 2, False, None),      # one decode token
    (7, 48, 40, 6, 2, True, None),       # ragged dims (masking in K and N), idle experts
    (70, 32, 24, 4, 1, False, 64),       # top-1, tiles of 64 rows
    (33, 96, 80, 3, 2, False, 16),       # K over several BLOCK_K steps, N over two BLOCK_N tiles
])
def test_fused_moe_matches_reference(tokens, hidden, inter, experts, top_k, skewed, block_m):
    x, w13, w2, weights, ids = moe_case(tokens, hidden, inter, experts, top_k, seed=hidden + tokens, skewed=skewed)
    want = torch_moe.fused_moe(x, w13, w2, weights, ids)
    dev = (lambda t: t.to(DEVICE))
    out = triton_moe.fused_moe(dev(x), dev(w13), dev(w2), dev(weights), dev(ids), block_m=block_m)
    assert out.shape == want.shape and rel_err(out.cpu(), want) < 1e-5


def test_fused_moe_no_tokens():
    x, w13, w2, weights, ids = moe_case(3, 16, 16, 4, 2, seed=0)
    assert triton_moe.fused_moe(x[:0].to(DEVICE), w13.to(DEVICE), w2.to(DEVICE), weights[:0].to(DEVICE),
                                ids[:0].to(DEVICE)).shape == (0, 16)
