"""fp8 (e4m3) weights: the quantization error bound, checkpoint forms, and fp8_linear against a
dequantize-then-matmul reference (on CPU through torch's _scaled_mm fallback; on CUDA in the GPU test)."""
from __future__ import annotations

import pytest
import torch

from pagedserve.executor.model.quant.fp8 import (FP8_DTYPE, Fp8Weight, check_fp8_device, check_fp8_shape,
                                                 combine_fp8_checkpoint, dequantize_fp8,
                                                 dequantize_fp8_checkpoint, fp8_checkpoint_to_channel,
                                                 fp8_linear, pack_fp8, quantize_fp8, quantize_fp8_per_token)


def _weight(out: int, cols: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    # Rows of very different magnitude, so a per-tensor scale would be visibly worse than per channel.
    return torch.randn(out, cols, generator=gen) * torch.logspace(-3, 0, out).unsqueeze(1)


def _within_e4m3_rounding(w: torch.Tensor, deq: torch.Tensor, scale: torch.Tensor) -> bool:
    """e4m3 keeps 3 mantissa bits: rounding is within 2**-4 of the value where it is normal (|v| >= 2**-6
    in code units), and within half the subnormal step 2**-9 below that."""
    bound = torch.maximum(w.abs() * 2.0 ** -4, scale.unsqueeze(1) * 2.0 ** -10)
    return bool(((w - deq).abs() <= bound * (1 + 1e-6)).all())


def test_quantize_fp8_error_bound():
    w = _weight(64, 96)
    w_fp8, scale = quantize_fp8(w)
    assert w_fp8.dtype == FP8_DTYPE and w_fp8.shape == (64, 96)
    assert scale.dtype == torch.float32 and scale.shape == (64,)
    deq = dequantize_fp8(w_fp8, scale)
    assert _within_e4m3_rounding(w, deq, scale)
    # Each row's largest magnitude lands on e4m3's largest code: the whole range is used.
    assert torch.equal(w_fp8.float().abs().amax(1), torch.full((64,), 448.0))
    # Per-channel scales keep the small rows: relative error per row stays at fp8's level.
    row_err = (w - deq).norm(dim=1) / w.norm(dim=1)
    assert row_err.max() < 0.04


def test_quantize_fp8_zero_row_and_dtype():
    w = _weight(16, 32).bfloat16()
    w[3] = 0
    w_fp8, scale = quantize_fp8(w)
    deq = dequantize_fp8(w_fp8, scale, torch.bfloat16)
    assert deq.dtype == torch.bfloat16 and torch.equal(deq[3], torch.zeros(32, dtype=torch.bfloat16))
    assert not torch.isnan(w_fp8.float()).any()


def test_per_token_activation_quantization():
    x = torch.randn(5, 64) * torch.tensor([1e-3, 1.0, 30.0, 0.0, 2.0]).unsqueeze(1)
    x_fp8, scale = quantize_fp8_per_token(x)
    assert scale.shape == (5, 1)
    assert _within_e4m3_rounding(x, x_fp8.float() * scale, scale.squeeze(1))


@pytest.mark.parametrize("m", [1, 7])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_linear_matches_dequantized_reference_cpu(m, dtype):
    w = _weight(48, 64, seed=1)
    x = torch.randn(2, m, 64).to(dtype)
    bias = torch.randn(48).to(dtype)
    w_fp8, w_scale = quantize_fp8(w)
    y = fp8_linear(x, w_fp8, w_scale, bias)
    assert y.shape == (2, m, 48) and y.dtype == dtype
    # Reference: the same fp8 codes of x and w, dequantized, multiplied in float32. Only the output's
    # rounding to `dtype` (and float32 summation order) separates them.
    x_fp8, x_scale = quantize_fp8_per_token(x.reshape(-1, 64))
    ref = (x_fp8.float() * x_scale) @ dequantize_fp8(w_fp8, w_scale).t() + bias.float()
    tol = 1e-5 if dtype == torch.float32 else 2 ** -7
    torch.testing.assert_close(y.reshape(-1, 48).float(), ref, rtol=tol, atol=tol * ref.abs().max().item())
    # And against the unquantized product: two e4m3 roundings, each within 2**-4 relative.
    exact = x.float().reshape(-1, 64) @ w.t() + bias.float()
    assert (y.reshape(-1, 48).float() - exact).norm() / exact.norm() < 0.06


def test_fp8_linear_static_input_scale():
    w_fp8, w_scale = quantize_fp8(_weight(32, 64, seed=2))
    x = torch.randn(3, 64)
    input_scale = torch.tensor(x.abs().max().item() / 448)
    y = fp8_linear(x, w_fp8, w_scale, input_scale=input_scale)
    ref = ((x / input_scale).to(FP8_DTYPE).float() * input_scale) @ dequantize_fp8(w_fp8, w_scale).t()
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)


def test_fp8_checkpoint_per_tensor_keeps_codes():
    w = _weight(32, 48, seed=3)
    scale = w.abs().max() / 448
    codes = (w / scale).to(FP8_DTYPE)
    w_fp8, per_row = fp8_checkpoint_to_channel(codes, scale.reshape(()))
    assert torch.equal(w_fp8.view(torch.uint8), codes.view(torch.uint8))
    assert torch.equal(per_row, scale.expand(32))
    with pytest.raises(ValueError, match="weight_scale"):
        fp8_checkpoint_to_channel(codes, torch.ones(5))


def test_fp8_checkpoint_blocks_requantized_per_channel():
    # Blocks of 16x32 over a 40x80 weight: ragged last blocks, as weight_block_size allows.
    w = _weight(40, 80, seed=4)
    block = (16, 32)
    scale_inv = torch.ones(3, 3)
    for bo in range(3):
        for bi in range(3):
            tile = w[bo * 16:(bo + 1) * 16, bi * 32:(bi + 1) * 32]
            scale_inv[bo, bi] = tile.abs().max() / 448
    expanded = scale_inv.repeat_interleave(16, 0)[:40].repeat_interleave(32, 1)[:, :80]
    codes = (w / expanded).to(FP8_DTYPE)
    stored = codes.float() * expanded                      # what the block checkpoint means
    w_fp8, scale = fp8_checkpoint_to_channel(codes, scale_inv, block)
    assert w_fp8.shape == (40, 80) and scale.shape == (40,)
    assert _within_e4m3_rounding(stored, dequantize_fp8(w_fp8, scale), scale)
    with pytest.raises(ValueError, match="weight_scale_inv"):
        fp8_checkpoint_to_channel(codes, torch.ones(2, 3), block)


def test_fp8_refuses_cpu_and_odd_shapes():
    with pytest.raises(ValueError, match="int8"):
        check_fp8_device("cpu")
    with pytest.raises(ValueError, match="CUDA"):
        pack_fp8(torch.randn(32, 64))               # what the layers call at load
    with pytest.raises(ValueError, match="in_features 24"):
        check_fp8_shape(32, 24)
    check_fp8_shape(32, 64)


def test_fp8_weight_form():
    w = _weight(32, 64, seed=6)
    packed = Fp8Weight(*quantize_fp8(w))
    assert packed.nbytes == 32 * 64 + 32 * 4                # one byte a weight, a float32 scale a row
    x = torch.randn(3, 64)
    torch.testing.assert_close(packed.apply(x), fp8_linear(x, packed.w, packed.scale), rtol=0, atol=0)
    assert _within_e4m3_rounding(w, packed.dequantize(), packed.scale)


def _block_checkpoint(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 codes and weight_scale_inv as a block-fp8 writer makes them."""
    bo, bi = block
    rows, cols = -(-w.shape[0] // bo), -(-w.shape[1] // bi)
    scale_inv = torch.stack([torch.stack([w[r * bo:(r + 1) * bo, c * bi:(c + 1) * bi].abs().max() / 448
                                          for c in range(cols)]) for r in range(rows)])
    expanded = scale_inv.repeat_interleave(bo, 0)[:w.shape[0]].repeat_interleave(bi, 1)[:, :w.shape[1]]
    return (w / expanded).to(FP8_DTYPE), scale_inv


def test_combine_fp8_checkpoint_stream():
    block = (16, 32)
    wa, wb = _weight(40, 80, seed=7), _weight(16, 80, seed=8)
    (ca, sa), (cb, sb) = _block_checkpoint(wa, block), _block_checkpoint(wb, block)
    items = [("model.layers.0.mlp.up_proj.weight_scale_inv", sa), ("model.norm.weight", torch.ones(80)),
             ("model.layers.0.mlp.up_proj.weight", ca), ("model.layers.0.mlp.up_proj.input_scale", torch.tensor(1.)),
             ("model.layers.0.self_attn.k_proj.weight", cb), ("model.layers.0.self_attn.k_scale", torch.tensor(1.)),
             ("model.layers.0.self_attn.k_proj.weight_scale_inv", sb)]
    got = dict(combine_fp8_checkpoint(iter(items), block))
    assert set(got) == {"model.norm.weight", "model.layers.0.mlp.up_proj.weight",
                        "model.layers.0.self_attn.k_proj.weight"}
    # Exactly the weight the file means: codes times their block's scale.
    assert torch.equal(got["model.layers.0.mlp.up_proj.weight"], dequantize_fp8_checkpoint(ca, sa, block))
    assert _within_e4m3_rounding(wb, got["model.layers.0.self_attn.k_proj.weight"], sb.amax(1).repeat_interleave(16))
    with pytest.raises(ValueError, match=r"lacks model.layers.0.mlp.up_proj.weight_scale_inv"):
        list(combine_fp8_checkpoint(iter(items[1:]), block))
    with pytest.raises(ValueError, match="weight_scale"):
        list(combine_fp8_checkpoint(iter(items), None))     # a block file read as per-tensor


def test_combine_quantized_tensors_routes_fp8_checkpoints():
    from pagedserve.common.quantization import QuantSpec
    from pagedserve.executor.model.quant.awq_gptq import combine_quantized_tensors
    w = _weight(16, 32, seed=9)
    scale = w.abs().max() / 448
    items = [("a.weight", (w / scale).to(FP8_DTYPE)), ("a.weight_scale", scale), ("b.weight", w)]
    got = dict(combine_quantized_tensors(iter(items), QuantSpec("fp8", bits=8, group_size=-1)))
    assert got["a.weight"].dtype == torch.float32 and torch.equal(got["b.weight"], w)
    assert _within_e4m3_rounding(w, got["a.weight"], scale.expand(16))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("m", [1, 17, 64])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_linear_cuda(m, dtype):
    check_fp8_device("cuda")
    w = _weight(512, 256, seed=5).cuda()
    w_fp8, w_scale = quantize_fp8(w)
    x = torch.randn(m, 256, device="cuda").to(dtype)
    bias = torch.randn(512, device="cuda").to(dtype)
    y = fp8_linear(x, w_fp8, w_scale, bias)
    assert y.dtype == dtype and y.shape == (m, 512)
    x_fp8, x_scale = quantize_fp8_per_token(x)
    ref = (x_fp8.float() * x_scale) @ dequantize_fp8(w_fp8, w_scale).t() + bias.float()
    # The GEMM writes bf16 (8 significant bits): within 2**-8 relative of the largest output, plus bias rounding.
    torch.testing.assert_close(y.float(), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())
