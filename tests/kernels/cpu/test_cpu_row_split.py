"""Merged layers whose pieces keep different forms (kernels/weights/weight_split.py, packing._row_split).

A Q4_K_M file stores q and k beside a v of another format (Q5_0 + Q8_0 at the 360M ladder model, Q4_K +
Q6_K at 1.7B). Through pack_linear such pieces become a RowSplitWeight of each run's own form (int4, the
5/6-bit pack, int8 for 8-bit runs), fewer bytes than one int8 weight, and its matmul matches the dequantized
pieces' at 1, 6 and 70 rows (the GEMV, the integer GEMM, the widening). Pieces one form holds stay one
weight. Through the real loader, tiny GGUF models with Q4_0 q/k beside a Q6_K v and Q5_0 q/k beside a Q8_0
v: the C decode step, steps of several rows included (where it gathers each part's columns), gives the greedy
tokens of the PyTorch path on the same weights (each part's method, the outputs concatenated), which the
matmul test above holds to the dequantized pieces. (Against the dequantized model itself the tokens of one
tiny random prompt part at a near tie: the int4 path's rounded inputs, not the split.)
"""
from __future__ import annotations

import pytest
import torch
from gguf import GGMLQuantizationType as T

from pagedserve import LLM
from pagedserve.executor.model.layers.linear_method import apply_linear
from pagedserve.executor.model.quant.packing import pack_linear
from pagedserve.kernels.weights.weight_intn import IntNWeight, intn_built
from pagedserve.kernels.weights.weight_only import Int4Weight, Int8Weight
from pagedserve.kernels.weights.weight_split import RowSplitWeight
from pagedserve.tests.helpers.kernels.cpu_kernels import c_step_runs
from pagedserve.tests.helpers.models.gguf_blocks import random_gguf_weight
from pagedserve.tests.helpers.models.gguf_models import write_tiny_gguf
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
from pagedserve.tests.helpers.rl.weight_update_cases import PROMPTS, greedy

CPU = torch.device("cpu")
needs_intn = pytest.mark.skipif(not intn_built(), reason="the 5/6-bit kernels need AVX512-VNNI, -VBMI and -BW")


def _pieces(types: tuple, rows: tuple) -> list:
    return [(sum(rows[:i]), random_gguf_weight(t, r, 512)) for i, (t, r) in enumerate(zip(types, rows))]


@needs_intn
@pytest.mark.parametrize("types,forms", [
    ((T.Q5_0, T.Q5_0, T.Q8_0), (IntNWeight, Int8Weight)),     # the 360M ladder model's q, k, v
    ((T.Q4_K, T.Q4_K, T.Q6_K), (Int4Weight, IntNWeight)),     # the 1.7B one's
    ((T.Q8_0, T.Q4_0, T.Q6_K), (Int8Weight, Int4Weight, IntNWeight))])
def test_mixed_pieces_keep_each_runs_own_form(types, forms):
    rows = (128, 64, 64)
    pieces = _pieces(types, rows)
    packed = pack_linear(pieces, sum(rows), "gguf", CPU, torch.float32, "test")
    assert isinstance(packed, RowSplitWeight)
    assert tuple(type(p) for p in packed.parts) == forms
    assert packed.out_features == sum(rows) and packed.nbytes < sum(rows) * 512      # int8's ~1 byte a weight
    ref_w = torch.cat([p.dequantize() for _, p in pieces]).double()
    # An int8 run is requantized per row: half a step of max|w| / 127 a weight, on top of bfloat16 scales.
    step = torch.cat([p.dequantize().abs().amax(1) / 254 if t == T.Q8_0 else torch.zeros(r)
                      for (_, p), t, r in zip(pieces, types, rows)]).double()
    bias = torch.randn(sum(rows))
    for n in (1, 6, 70):
        x = torch.randn(n, 512, generator=torch.Generator().manual_seed(n))
        y = apply_linear(x, packed, bias).double()
        ax = x.double().abs()
        bound = 1e-2 * (ax @ ref_w.abs().t()) + ax.sum(1, keepdim=True) * step + 1e-5
        assert ((y - x.double() @ ref_w.t() - bias.double()).abs() <= bound).all()


@needs_intn
def test_pieces_one_form_holds_stay_one_weight():
    assert isinstance(pack_linear(_pieces((T.Q4_0, T.Q5_0), (64, 64)), 128, "gguf", CPU, torch.float32, "t"),
                      IntNWeight)
    assert isinstance(pack_linear(_pieces((T.Q8_0, T.Q8_0), (64, 64)), 128, "gguf", CPU, torch.float32, "t"),
                      Int8Weight)
    # A run of rows no narrow form blocks (not a multiple of 64), and nothing narrow left: one int8 weight.
    assert isinstance(pack_linear(_pieces((T.Q5_0, T.Q8_0), (32, 32)), 64, "gguf", CPU, torch.float32, "t"),
                      Int8Weight)


# Without the 5/6-bit kernels (an AVX2 machine) 5/6-bit runs are int8: Q4_0 q/k beside a Q6_K v still split.
@pytest.mark.skipif(not c_step_runs(), reason="the C step needs the AVX-512 or AVX2 + FMA build of the CPU kernels")
@pytest.mark.parametrize("v_type,default,forms", [
    ("Q6_K", "Q4_0", (Int4Weight, IntNWeight) if intn_built() else (Int4Weight, Int8Weight)),
    pytest.param("Q8_0", "Q5_0", (IntNWeight, Int8Weight), marks=needs_intn)])
def test_the_c_step_runs_a_split_qkv_as_the_pytorch_path_does(tmp_path, v_type, default, forms):
    hf = make_tiny_model(str(tmp_path / "hf"), hidden_size=256, intermediate_size=512)
    path = write_tiny_gguf(hf, str(tmp_path / "mixed.gguf"), {"attn_v.weight": v_type, "token_embd.weight": "Q8_0",
                                                             "output.weight": "Q8_0"}, default=default)
    with LLM(path, tokenizer=hf) as llm:
        runner = llm.engine.executor.worker.runner
        qkv = runner.model.model.layers[0].self_attn.qkv_proj.packed
        assert isinstance(qkv, RowSplitWeight) and qkv.widths == (256 + 128, 128)
        assert tuple(type(p) for p in qkv.parts) == forms
        assert runner.decode_step is not None and len(PROMPTS) > 1       # steps of several rows too
        with_step = greedy(llm)
        runner.decode_step = None                                         # each part's method, concatenated
        assert greedy(llm) == with_step


@needs_intn
def test_a_reload_overwrites_a_split_weight_in_place(tmp_path):
    files = []
    for seed in (0, 1):
        hf = make_tiny_model(str(tmp_path / f"hf{seed}"), seed=seed, hidden_size=256, intermediate_size=512)
        files.append(write_tiny_gguf(hf, str(tmp_path / f"m{seed}.gguf"),
                                     {"attn_v.weight": "Q8_0", "token_embd.weight": "Q8_0", "output.weight": "Q8_0"},
                                     default="Q5_0"))
    with LLM(files[1], tokenizer=hf) as llm:
        want = greedy(llm)
    with LLM(files[0], tokenizer=hf) as llm:
        runner = llm.engine.executor.worker.runner
        qkv = runner.model.model.layers[0].self_attn.qkv_proj.packed
        pointers = [part.packed.data_ptr() if isinstance(part, IntNWeight) else part.q.data_ptr() for part in qkv.parts]
        before = greedy(llm)
        llm.reload_weights(weights_path=files[1])
        assert runner.model.model.layers[0].self_attn.qkv_proj.packed is qkv     # the C step's pointers hold
        assert [part.packed.data_ptr() if isinstance(part, IntNWeight) else part.q.data_ptr()
                for part in qkv.parts] == pointers
        assert greedy(llm) == want != before
