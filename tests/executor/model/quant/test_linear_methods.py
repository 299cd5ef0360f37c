"""Each linear layer's method is picked once, at load, from the form its weight ends up in: float checkpoints
keep the dense method, --quantization int8 the int8 one, GGUF files int4 or int8 per layer (their formats mix),
AWQ/GPTQ int4 (behind an input gather for act-order), fp8 its own; a tied head runs the embedding's table."""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from pagedserve.common.quantization import QuantSpec, checkpoint_quant_spec, resolve_quantization
from pagedserve.executor.model.layers.linear import (ColumnParallelLinear, LinearBase, MergedColumnParallelLinear,
                                                     QKVParallelLinear, RowParallelLinear)
from pagedserve.executor.model.layers.linear_method import (ActOrderInt4LinearMethod, Fp8LinearMethod,
                                                            Int4LinearMethod, Int8LinearMethod,
                                                            UnquantizedLinearMethod, apply_linear, linear_method_for)
from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.executor.model.quant.fp8 import Fp8Weight, fp8_linear, quantize_fp8
from pagedserve.executor.model.quant.packing import PermutedInput
from pagedserve.kernels.weights.weight_only import Int4Weight, Int8Weight
from pagedserve.tests.helpers.parity import model_config

_METHOD_OF = {Int4Weight: Int4LinearMethod, PermutedInput: ActOrderInt4LinearMethod, Int8Weight: Int8LinearMethod}


def _linears(model: torch.nn.Module) -> list[LinearBase]:
    return [m for m in model.modules() if isinstance(m, LinearBase)]


def _load(path: str, quantization: QuantSpec | None = None) -> torch.nn.Module:
    return load_model(dataclasses.replace(model_config(path), quantization=quantization), TPGroup())


@torch.inference_mode()
def test_float_checkpoint_keeps_the_dense_method(tiny_llama_dir):
    model = _load(tiny_llama_dir)
    for layer in _linears(model) + [model.lm_head]:
        assert type(layer.method) is UnquantizedLinearMethod and layer.packed is None
    qkv = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(3, qkv.in_features)
    torch.testing.assert_close(qkv(x), F.linear(x, qkv.weight, qkv.bias), rtol=0, atol=0)


@torch.inference_mode()
def test_int8_at_load(tiny_llama_dir):
    model = _load(tiny_llama_dir, resolve_quantization("int8", None, is_gguf=False))
    for layer in _linears(model) + [model.lm_head]:
        assert isinstance(layer.packed, Int8Weight) and type(layer.method) is Int8LinearMethod
    down = model.model.layers[1].mlp.down_proj
    x = torch.randn(5, down.in_features)
    torch.testing.assert_close(down(x), apply_linear(x, down.packed), rtol=0, atol=0)


@pytest.mark.slow
@torch.inference_mode()
def test_gguf_layers_take_their_own_formats_method(smollm2_path):
    model = _load(smollm2_path, resolve_quantization(None, None, is_gguf=True))
    forms = set()
    for layer in _linears(model):
        forms.add(type(layer.packed))
        assert type(layer.method) is _METHOD_OF[type(layer.packed)], (layer, type(layer.packed))
    assert Int4Weight in forms                       # the embedded file's Q4_1 layers
    head, embedding = model.lm_head, model.model.embed_tokens
    assert head.tied_to is embedding and head.packed is embedding.packed      # tied: one Q8_0 table
    assert type(head.method) is Int8LinearMethod


@pytest.mark.parametrize("method,desc_act", [("awq", False), ("gptq", False), ("gptq", True)])
@torch.inference_mode()
def test_awq_gptq_layers_take_the_int4_method(tmp_path, method, desc_act):
    from transformers import AutoConfig
    from pagedserve.tests.helpers.models.quant_checkpoints import write_quantized_checkpoint
    from pagedserve.tests.helpers.models.tiny_models import make_tiny_model
    float_dir = make_tiny_model(str(tmp_path / "float"), tokenizer="synthetic", hidden_size=128,
                                intermediate_size=256)
    quant_dir = str(tmp_path / method)
    write_quantized_checkpoint(float_dir, quant_dir, str(tmp_path / "dequant"), method, group_size=32,
                               desc_act=desc_act)
    model = _load(quant_dir, checkpoint_quant_spec(AutoConfig.from_pretrained(quant_dir)))
    want = ActOrderInt4LinearMethod if desc_act else Int4LinearMethod
    for layer in _linears(model):
        assert type(layer.method) is want
    assert type(model.lm_head.method) is UnquantizedLinearMethod         # the head stays float in these files
    layer = model.model.layers[0].mlp.gate_up_proj
    x = torch.randn(2, layer.in_features)
    torch.testing.assert_close(layer(x), apply_linear(x, layer.packed), rtol=0, atol=0)


def test_fp8_weight_takes_the_fp8_method():
    """fp8 packs only on a GPU (check_fp8_device); its method runs on CPU through torch's _scaled_mm fallback."""
    w = torch.randn(32, 64)
    packed = Fp8Weight(*quantize_fp8(w))
    assert type(linear_method_for(packed, "cuda")) is Fp8LinearMethod
    x, bias = torch.randn(3, 64), torch.randn(32)
    torch.testing.assert_close(apply_linear(x, packed, bias), fp8_linear(x, packed.w, packed.scale, bias),
                               rtol=0, atol=0)


def test_unknown_weight_form_is_refused():
    with pytest.raises(TypeError, match="no linear method"):
        linear_method_for(object(), "cpu")


def test_output_partition_sizes_name_each_projection():
    """What a LoRA wrapper slices a merged layer's output by: this rank's size of each projection."""
    tp = TPGroup(rank=1, size=2)
    assert QKVParallelLinear(64, 16, 8, 2, False, tp).output_partition_sizes == [64, 16, 16]
    assert MergedColumnParallelLinear(64, [96, 96], False, tp).output_partition_sizes == [48, 48]
    assert ColumnParallelLinear(64, 96, False, tp).output_partition_sizes == [48]
    row = RowParallelLinear(64, 96, True, tp)
    assert (row.in_features, row.out_features, row.output_partition_sizes) == (32, 96, [96])
