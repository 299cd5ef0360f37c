"""LoRA's shrink and expand on the GPU, one program per (token, output tile), each token reading its own
adapter slot (vLLM's per-token "bgmv" shape for decode-sized steps).

The launch grid depends only on the number of tokens and the pool's shape, never on which adapters the step
mixes, and the token -> slot map is a device tensor: a step can be captured in a CUDA graph and replayed with
another mix. A slot of -1 is the base model (no delta). Slots past an adapter's rank hold zeros, so the full
pool width is summed. Same contract as executor/model/layers/lora.py's grouped torch path.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, out_ptr, K, W, stride_xt, stride_as, stride_aw, stride_ot,
                   BLOCK_W: tl.constexpr, BLOCK_K: tl.constexpr):
    """out[t, w] = sum_k A[slot[t], w, k] * x[t, k] (zeros for slot -1)."""
    t, pw = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    ws = pw * BLOCK_W + tl.arange(0, BLOCK_W)
    w_ok = ws < W
    acc = tl.zeros([BLOCK_W], tl.float32)
    if slot >= 0:
        ks = tl.arange(0, BLOCK_K)
        for k0 in range(0, K, BLOCK_K):
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptr + t * stride_xt + k0 + ks, mask=k_ok, other=0.0).to(tl.float32)
            a = tl.load(a_ptr + slot * stride_as + ws[:, None] * stride_aw + (k0 + ks)[None, :],
                        mask=w_ok[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
            acc += tl.sum(a * x[None, :], axis=1)
    tl.store(out_ptr + t * stride_ot + ws, acc, mask=w_ok)


@triton.jit
def _expand_kernel(xa_ptr, b_ptr, slot_ptr, y_ptr, N, W, stride_xat, stride_bs, stride_bn, stride_bw, stride_yt,
                   BLOCK_N: tl.constexpr, BLOCK_W: tl.constexpr):
    """y[t, n] += sum_w B[slot[t], n, w] * xa[t, w] (untouched for slot -1)."""
    t, pn = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    ns = pn * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = ns < N
    ws = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N], tl.float32)
    for w0 in range(0, W, BLOCK_W):
        w_ok = (w0 + ws) < W
        xa = tl.load(xa_ptr + t * stride_xat + w0 + ws, mask=w_ok, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + ns[:, None] * stride_bn + (w0 + ws)[None, :] * stride_bw,
                    mask=n_ok[:, None] & w_ok[None, :], other=0.0).to(tl.float32)
        acc += tl.sum(b * xa[None, :], axis=1)
    y = tl.load(y_ptr + t * stride_yt + ns, mask=n_ok, other=0.0)
    tl.store(y_ptr + t * stride_yt + ns, (y.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=n_ok)


def lora_delta(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, token_slots: torch.Tensor,
               y: torch.Tensor) -> torch.Tensor:
    """y[t] += (x[t] A[s]^T) B[s]^T with s = token_slots[t], in place. x [T, K], a [S, W, K], b [S, N, W],
    token_slots int32 [T] (-1: none), y [T, N]; b may be a transposed view (the pool keeps B as [S, W, N])."""
    tokens, k = x.shape
    _, w, _ = a.shape
    n = b.shape[1]
    if tokens == 0:
        return y
    xa = torch.empty(tokens, w, dtype=torch.float32, device=x.device)
    block_w = max(16, triton.next_power_of_2(min(w, 64)))
    _shrink_kernel[(tokens, triton.cdiv(w, block_w))](x, a, token_slots, xa, k, w, x.stride(0), a.stride(0),
                                                      a.stride(1), xa.stride(0), BLOCK_W=block_w, BLOCK_K=64)
    _expand_kernel[(tokens, triton.cdiv(n, 64))](xa, b, token_slots, y, n, w, xa.stride(0), b.stride(0),
                                                 b.stride(1), b.stride(2), y.stride(0), BLOCK_N=64, BLOCK_W=block_w)
    return y
