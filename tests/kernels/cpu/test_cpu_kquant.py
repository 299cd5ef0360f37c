"""The K form of int4 group scales (kernels/weights/weight_kquant.py; SZ_K in kernels/cpu/csrc/gemv.h): a GGUF Q4_K's
two-level scales kept at 4.625 bits a weight, exactly, in every CPU int4 kernel.

Q4_K pieces (random bytes: every sub-scale code, so the largest need not be 63; and llama.cpp's reference
layout, where it is) pack to the K form with every (scale, offset) the file's, bit for bit, and each kernel that
reads an int4 pack (the float GEMV, the int16 GEMM at every row count, its int8-input and AMX forms, the
widening, the embedding rows, torch's own kernel through the expanded pairs) matches the float64 matmul of
the file's weights. Scales that do not factor (Q4_1's float16 scale per group) keep the bfloat16 pairs, Q4_0's
its scales alone. Through the real loader a tiny Q4_K model's C decode step gives the PyTorch layers' tokens.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedserve import LLM
from pagedserve.executor.model.quant.gguf_blocks import decode_gguf_tensor
from pagedserve.executor.model.quant.packing import pack_linear
from pagedserve.kernels.cpu import dequant as cpu_dequant
from pagedserve.kernels.cpu import int4_pack
from pagedserve.kernels.cpu import native as cpu_native
from pagedserve.kernels.cpu.int4_pack import PACK_AVX2, PACK_AVX512
from pagedserve.kernels.weights import weight_only
from pagedserve.kernels.weights.weight_kquant import k_form_scale_offset, k_form_scales
from pagedserve.tests.helpers.models.gguf_blocks import random_gguf_weight
from pagedserve.tests.helpers.models.gguf_models import quantize_q4_k, write_tiny_gguf
from pagedserve.tests.helpers.kernels.int4_cases import assert_float64_close
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
from pagedserve.tests.helpers.rl.weight_update_cases import greedy

CPU = torch.device("cpu")
LIB = cpu_native.library()
needs_kernels = pytest.mark.skipif(LIB is None or not LIB.ps_gemm_int4_vectorized(),
                                   reason="the K form is kept where the int4 C kernels run (AVX512-VNNI)")


def _q4_k(rows: int, cols: int, reference: bool):
    if not reference:
        return random_gguf_weight(T.Q4_K, rows, cols)
    w = np.random.default_rng(rows + cols).standard_normal((rows, cols)).astype(np.float32) * 0.05
    return decode_gguf_tensor(quantize_q4_k(w), T.Q4_K, (rows, cols))


def _packed(piece) -> weight_only.Int4Weight:
    rows = piece.q.shape[0]
    return pack_linear([(0, piece)], rows, "gguf", CPU, torch.float32, "test")


@needs_kernels
@pytest.mark.parametrize("reference", [False, True])
def test_q4_k_scales_keep_their_two_levels_exactly(reference):
    piece = _q4_k(128, 512, reference)
    w = _packed(piece)
    assert w.sz_form == cpu_native.SZ_K and w.scales_and_zeros.dtype == torch.int16
    assert w.nbytes * 8 == 128 * 512 * 4.625                          # against 5 bits with bfloat16 pairs
    scale, offset = k_form_scale_offset(w.scales_and_zeros, 512 // 32)
    assert torch.equal(scale, piece.scale.t()) and torch.equal(offset, piece.offset.t())


@needs_kernels
def test_scales_that_do_not_factor_keep_their_forms():
    assert _packed(random_gguf_weight(T.Q4_1, 128, 512)).sz_form == cpu_native.SZ_PAIRS
    assert _packed(random_gguf_weight(T.Q4_0, 128, 512)).sz_form == cpu_native.SZ_SCALES
    # One block's scale off the base by a float32 ulp: no exact factoring, so the pairs.
    piece = _q4_k(64, 256, True)
    scale = piece.scale.clone()
    scale[3, 5] = torch.nextafter(scale[3, 5], torch.tensor(1.0))
    assert k_form_scales(scale, piece.offset) is None
    assert k_form_scales(piece.scale[:, :4], piece.offset[:, :4]) is None     # not whole blocks of 8 groups


def _native(kernel: str, w: weight_only.Int4Weight, x: torch.Tensor, *layout: int) -> torch.Tensor:
    y = torch.full((x.shape[0], w.out_features), float("nan"))
    assert getattr(LIB, kernel)(w.packed.data_ptr(), w.scales_and_zeros.data_ptr(), w.sz_form, *layout, w.out_features,
                                w.in_features, w.group_size, x.data_ptr(), x.shape[0], y.data_ptr(), 2) == 0
    return y


@needs_kernels
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8, 33])
def test_the_gemv_and_the_int16_gemm_read_the_k_form(rows):
    piece = _q4_k(192, 1024, False)
    w, dense = _packed(piece), piece.dequantize().double()
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
    offsets = 8 * piece.scale.double().abs().repeat_interleave(32, 1)
    if rows <= 8:
        assert_float64_close(_native("ps_gemv_int4", w, x, PACK_AVX512), x, dense, offsets=offsets)
    assert_float64_close(_native("ps_gemm_int4", w, x), x, dense, int16_inputs=True, offsets=offsets)
    assert_float64_close(weight_only.int4_linear(x, w), x, dense, int16_inputs=True, offsets=offsets)


@needs_kernels
@pytest.mark.skipif(LIB is None or not LIB.ps_gemm_int4_s8_built(), reason="the int8-input form needs VBMI")
@pytest.mark.parametrize("kernel", ["ps_gemm_int4_s8", "ps_gemm_int4_s8_vnni"])
def test_the_int8_input_forms_read_the_k_form(kernel):
    piece = _q4_k(128, 512, True)
    w, dense = _packed(piece), piece.dequantize().double()
    x = torch.randn(230, 512, generator=torch.Generator().manual_seed(3))
    offsets = 8 * piece.scale.double().abs().repeat_interleave(32, 1)
    assert_float64_close(_native(kernel, w, x), x, dense, int8_group=32, offsets=offsets)


@needs_kernels
def test_widening_embedding_rows_and_torch_kernel_read_the_k_form():
    piece = _q4_k(128, 512, False)
    w, dense = _packed(piece), piece.dequantize()
    widened = cpu_dequant.int4_to_bf16_t(w.packed, w.scales_and_zeros, 128, 512, 32).float()
    assert ((widened - dense.t()).abs() <= dense.t().abs() * 2 ** -8 + 1e-30).all()     # rounded once to bfloat16
    ids = torch.tensor([[0, 77], [127, 5]])
    rows = weight_only.int4_embedding(ids, w, torch.float32)
    torch.testing.assert_close(rows, dense[ids], rtol=1e-6, atol=1e-9)       # float32 (a fused multiply-add)
    # torch's own int4 kernel (calls our kernels do not take) reads the form expanded to bfloat16 pairs.
    x = torch.randn(4, 512, generator=torch.Generator().manual_seed(1))
    y = torch._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16), w.packed, 32, weight_only.scale_zero_pairs(w))
    ref = x.double() @ dense.double().t()
    assert ((y.double() - ref).abs() <= 0.02 * (x.double().abs() @ dense.double().abs().t()) + 1e-3).all()


@needs_kernels
def test_a_q4_k_model_runs_the_c_step_as_the_pytorch_layers_do(tmp_path):
    hf = make_tiny_model(str(tmp_path / "hf"), hidden_size=256, intermediate_size=512)
    path = write_tiny_gguf(hf, str(tmp_path / "q4_k.gguf"), {"token_embd.weight": "Q8_0", "output.weight": "Q8_0"},
                           default="Q4_K")
    # No prefix caching: the second run would start from the first one's cache, whose prefill chunks differ
    # (this random model's first token is a near tie, 0.002 nats, which the chunking alone flips).
    with LLM(path, tokenizer=hf, enable_prefix_caching=False) as llm:
        runner = llm.engine.executor.worker.runner
        layer = runner.model.model.layers[0]
        assert {layer.self_attn.qkv_proj.packed.sz_form, layer.mlp.down_proj.packed.sz_form} == {cpu_native.SZ_K}
        assert runner.decode_step is not None
        with_step = greedy(llm)
        runner.decode_step = None
        assert greedy(llm) == with_step


@pytest.mark.skipif(LIB is None or not LIB.ps_gemv_int4_layouts() >> PACK_AVX2 & 1,
                    reason="the AVX2 int4 GEMV needs a CPU with AVX2, FMA and F16C")
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 8])
def test_the_avx2_gemv_reads_the_k_form(rows):
    """The AVX2 GEMV (gemv_avx2.c) over the K form in torch's AVX2 pack, built here whatever this machine's pack
    (the loader keeps the K form only where the int4 GEMM runs, so no model reaches it on AVX2 yet)."""
    piece = _q4_k(192, 1024, False)
    sz = k_form_scales(piece.scale, piece.offset)
    assert sz is not None
    w = weight_only.Int4Weight(int4_pack.pack_codes(piece.q, PACK_AVX2), sz, 32, 192, 1024)
    assert w.sz_form == cpu_native.SZ_K
    dense = piece.dequantize().double()
    x = torch.randn(rows, 1024, generator=torch.Generator().manual_seed(rows))
    offsets = 8 * piece.scale.double().abs().repeat_interleave(32, 1)
    assert_float64_close(_native("ps_gemv_int4", w, x, PACK_AVX2), x, dense, offsets=offsets)
