"""The 5- and 6-bit pack (kernels/weights/weight_intn.py) and its kernels (kernels/cpu/csrc/gemm_intn.c).

The pack: read back in PyTorch it gives the codes and bfloat16 scales it was made of, bit for bit.
The integer GEMM: against a float64 matmul of those exact weights, with the inputs as it rounds them (int16
steps of max|x| / 32767 per row) only float32 summation is left; with the inputs as given each moves by at
most half a step on top. Every row count from 1 past a few 4-row passes, both widths, groups of 16 (Q6_K) and
32, with and without zeros; a row's bits do not depend on the rows beside it. The widening gives exactly the
bfloat16 of those weights. Through pack_linear, GGUF's 5/6-bit formats take the pack where it is smaller than
int8 and match the dequantized matmul; a tiny GGUF model of Q5_0 / Q5_1 / Q6_K layers gives the dequantized
model's greedy tokens through the real loader and the C decode step.
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedserve import LLM
from pagedserve.executor.model.layers.linear_method import apply_linear
from pagedserve.executor.model.quant.packing import pack_linear
from pagedserve.kernels.weights import weight_intn
from pagedserve.kernels.weights.weight_intn import IntNWeight, intn_built, intn_linear, pack_intn
from pagedserve.kernels.weights.weight_only import Int8Weight
from pagedserve.tests.helpers.models.gguf_blocks import random_gguf_weight
from pagedserve.tests.helpers.models.gguf_models import write_tiny_gguf
from pagedserve.tests.helpers.kernels.int4_cases import assert_float64_close as _close
from pagedserve.tests.helpers.kernels.intn_reference import intn_dequantize
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
from pagedserve.tests.helpers.rl.weight_update_cases import PROMPTS, greedy

needs_intn = pytest.mark.skipif(not intn_built(), reason="the 5/6-bit kernels need AVX512-VNNI, -VBMI and -BW and a C "
                                                         "compiler (elsewhere such layers load as int8)")
CPU = torch.device("cpu")


def _case(out: int, cols: int, bits: int, group: int, zeros: bool, seed: int) -> tuple[IntNWeight, torch.Tensor]:
    """A pack and the float64 weight it holds ((q - 2^(bits-1)) * scale + zero, scales in bfloat16)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (out, cols), generator=gen, dtype=torch.uint8)
    scale = torch.rand(out, cols // group, generator=gen) * 0.05
    zero = torch.randn(out, cols // group, generator=gen) * 0.1 if zeros else torch.zeros(out, cols // group)
    w = pack_intn(q, scale, zero, bits, group)
    s64, z64 = (t.to(torch.bfloat16).double().repeat_interleave(group, 1) for t in (scale, zero))
    return w, (q.double() - (1 << (bits - 1))) * s64 + z64


def _offsets(w: IntNWeight) -> torch.Tensor:
    """2^(bits-1) * |scale| per weight: the terms the GEMM cancels (it sums codes, then subtracts mid * scale *
    sum(x) per group), whose float32 rounding an output near 0 still carries."""
    scales = w.scales_and_zeros[..., 0].double().abs().t()
    return (1 << (w.bits - 1)) * scales.repeat_interleave(w.group_size, 1)


def _rounded(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel rounds it (int16 steps of max|x| / 32767 per row), in its float32 order of operations."""
    top = x.abs().amax(1, keepdim=True).double()
    return torch.round(x * (32767 / top).float()) * (top / 32767).float()


SHAPES = [(64, 64, 5, 32, False), (192, 576, 5, 32, True), (128, 256, 6, 16, False), (64, 512, 6, 32, True)]


@pytest.mark.parametrize("out,cols,bits,group,zeros", SHAPES)
def test_the_pack_holds_its_codes_and_bfloat16_scales(out, cols, bits, group, zeros):
    w, dense = _case(out, cols, bits, group, zeros, seed=out + bits)
    assert w.scales_and_zeros.shape == (cols // group, out, 2 if zeros else 1)
    assert w.packed.shape == (out // 64, cols // 2, 64 + 16 * (bits - 4))
    assert torch.equal(intn_dequantize(w).double(), dense)


def test_the_pack_refuses_what_it_cannot_hold():
    q = torch.zeros(64, 64, dtype=torch.uint8)
    s = torch.ones(64, 2)
    with pytest.raises(ValueError, match="do not fit 5 bits"):
        pack_intn(q + 32, s, s, 5, 32)
    with pytest.raises(ValueError, match=r"\[48, 64\]"):
        pack_intn(q[:48], s[:48], s[:48], 5, 32)
    with pytest.raises(ValueError, match="takes"):
        pack_intn(q, s, s, 8, 32)


@needs_intn
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8, 9, 13, 17, 33, 64, 200])
@pytest.mark.parametrize("out,cols,bits,group,zeros", SHAPES)
def test_intn_gemm_matches_the_weights(rows, out, cols, bits, group, zeros):
    w, dense = _case(out, cols, bits, group, zeros, seed=rows + out + bits)
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows))
    x[0, cols // 3] = 50.0                               # one outlier: row 0's step is 50 / 32767
    y = intn_linear(x, w, dense_min_rows=1 << 30)
    _close(y, _rounded(x), dense, offsets=_offsets(w))   # only float32 sums differ from the rounded inputs
    _close(y, x, dense, int16_inputs=True, offsets=_offsets(w))


@needs_intn
def test_a_rows_bits_do_not_depend_on_the_rows_beside_it():
    w, _ = _case(192, 576, 5, 32, True, seed=3)
    x = torch.randn(7, 576, generator=torch.Generator().manual_seed(4))
    together = intn_linear(x, w, dense_min_rows=1 << 30)
    alone = torch.cat([intn_linear(x[i:i + 1], w, dense_min_rows=1 << 30) for i in range(7)])
    assert torch.equal(together, alone)


@needs_intn
@pytest.mark.parametrize("out,cols,bits,group,zeros", SHAPES)
def test_many_rows_widen_to_the_exact_bfloat16_weights(out, cols, bits, group, zeros):
    w, dense = _case(out, cols, bits, group, zeros, seed=out + group)
    assert torch.equal(weight_intn.intn_to_bf16_t(w), dense.to(torch.bfloat16).t())
    x = torch.randn(weight_intn.INTN_DENSE_MIN_ROWS, cols, generator=torch.Generator().manual_seed(5))
    y = intn_linear(x, w)                                # bfloat16 inputs: relative 2^-9 each, float32 sums
    assert ((y.double() - x.double() @ dense.t()).abs() <= 1e-2 * (x.double().abs() @ dense.abs().t())).all()


def _gguf(qtype: T):
    return random_gguf_weight(qtype, 64, 512)


@needs_intn
@pytest.mark.parametrize("types,form", [
    ((T.Q5_0,), (5, 32, 1)), ((T.Q5_1,), (5, 32, 2)), ((T.Q5_K,), (5, 32, 2)), ((T.Q6_K,), (6, 16, 1)),
    ((T.Q4_0, T.Q5_0), (5, 32, 2)),     # a 4-bit piece beside a 5-bit one: its codes in the 5-bit pack
    ((T.Q8_0,), None)])
def test_gguf_5_and_6_bit_layers_keep_their_width(types, form):
    pieces = [(64 * i, _gguf(t)) for i, t in enumerate(types)]
    packed = pack_linear(pieces, 64 * len(types), "gguf", CPU, torch.float32, "test")
    if form is None:
        assert isinstance(packed, Int8Weight)
        return
    assert isinstance(packed, IntNWeight)
    assert (packed.bits, packed.group_size, packed.scales_and_zeros.shape[-1]) == form
    ref_w = torch.cat([p.dequantize() for _, p in pieces]).double()
    assert packed.nbytes < ref_w.numel()                  # fewer bytes than int8's one a weight
    for rows in (1, 6, 70):
        x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows))
        y = apply_linear(x, packed).double()
        # bfloat16 scales (and inputs, where 70 rows widen): relative 2^-9 each, as the int4 layers' bound
        assert ((y - x.double() @ ref_w.t()).abs() <= 1e-2 * (x.double().abs() @ ref_w.abs().t()) + 1e-6).all()


@needs_intn
def test_a_q5_q6_gguf_model_gives_the_dequantized_models_tokens(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), hidden_size=256, intermediate_size=512)
    path = write_tiny_gguf(hf, str(tmp_path / "q5.gguf"), {"attn_v.weight": "Q5_1", "ffn_down.weight": "Q6_K",
                                                          "token_embd.weight": "Q8_0", "output.weight": "Q8_0"},
                           default="Q5_0")
    with LLM(path, tokenizer=hf, quantization="none", dtype="float32") as llm:
        want = greedy(llm)
    with LLM(path, tokenizer=hf) as llm:
        runner = llm.engine.executor.worker.runner
        layer = runner.model.model.layers[0]
        forms = [(p.bits, p.scales_and_zeros.shape[-1]) for p in (layer.self_attn.qkv_proj.packed,
                                                                  layer.mlp.gate_up_proj.packed,
                                                                  layer.mlp.down_proj.packed)]
        assert forms == [(5, 2), (5, 1), (6, 1)]          # q/k Q5_0 beside v Q5_1: zeros kept
        assert runner.decode_step is not None             # decode steps run the C step's 5/6-bit linears
        assert greedy(llm) == want
