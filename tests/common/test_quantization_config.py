"""common/quantization.py: reading a checkpoint's quantization_config and choosing the method (vLLM's rule)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
from transformers import AwqConfig, FineGrainedFP8Config, GPTQConfig

from pagedserve.common.quantization import (QUANTIZATION_CHOICES, QuantSpec, checkpoint_quant_spec,
                                            resolve_quantization)


def _hf(quantization_config) -> SimpleNamespace:
    return SimpleNamespace(quantization_config=quantization_config)


def test_awq_config_dict_and_object():
    cfg = AwqConfig(bits=4, group_size=64, zero_point=True, version="gemm", modules_to_not_convert=["lm_head"])
    for raw in (cfg.to_dict(), cfg):
        spec = checkpoint_quant_spec(_hf(raw))
        assert spec == QuantSpec("awq", bits=4, group_size=64, zero_point=True, modules_to_not_convert=("lm_head",))
    assert not spec.is_quantized_module("lm_head") and spec.is_quantized_module("model.layers.0.mlp.up_proj")


def test_awq_as_autoawq_writes_it():
    # The config.json of e.g. Qwen2.5-7B-Instruct-AWQ, and AutoAWQ's older w_bit / q_group_size spelling.
    spec = checkpoint_quant_spec({"quantization_config": {"bits": 4, "group_size": 128, "modules_to_not_convert": None,
                                                          "quant_method": "awq", "version": "gemm",
                                                          "zero_point": True}})
    assert (spec.method, spec.bits, spec.group_size, spec.modules_to_not_convert) == ("awq", 4, 128, ())
    old = checkpoint_quant_spec(_hf({"quant_method": "awq", "w_bit": 4, "q_group_size": 32, "version": "GEMM"}))
    assert (old.bits, old.group_size) == (4, 32)


@pytest.mark.parametrize("bad,field", [({"version": "gemv"}, "version"), ({"zero_point": False}, "zero_point"),
                                       ({"bits": 3}, "bits")])
def test_awq_unsupported_variants(bad, field):
    with pytest.raises(ValueError, match=field):
        checkpoint_quant_spec(_hf({"quant_method": "awq", "bits": 4, "group_size": 128, **bad}))


def test_gptq_config():
    spec = checkpoint_quant_spec(_hf(GPTQConfig(bits=4, group_size=32, desc_act=True, sym=False).to_dict()))
    assert spec == QuantSpec("gptq", bits=4, group_size=32, desc_act=True, sym=False, checkpoint_format="gptq")
    v2 = checkpoint_quant_spec(_hf(GPTQConfig(bits=8, group_size=-1, checkpoint_format="gptq_v2")))
    assert (v2.bits, v2.group_size, v2.checkpoint_format) == (8, -1, "gptq_v2")
    # GPTQModel writes the format under "format".
    v2b = checkpoint_quant_spec(_hf({"quant_method": "gptq", "bits": 4, "group_size": 128, "format": "gptq_v2"}))
    assert v2b.checkpoint_format == "gptq_v2"
    with pytest.raises(ValueError, match="checkpoint_format"):
        checkpoint_quant_spec(_hf({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}))
    with pytest.raises(ValueError, match="bits"):
        checkpoint_quant_spec(_hf({"quant_method": "gptq", "bits": 3, "group_size": 128}))
    with pytest.raises(ValueError, match="dynamic"):
        checkpoint_quant_spec(_hf({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*lm_head": {}}}))
    assert checkpoint_quant_spec(_hf({"quant_method": "gptq", "bits": 4, "dynamic": None})).method == "gptq"


def test_fp8_config():
    block = checkpoint_quant_spec(_hf(FineGrainedFP8Config().to_dict()))
    assert (block.method, block.activation_scheme, block.weight_block_size) == ("fp8", "dynamic", (128, 128))
    per_tensor = checkpoint_quant_spec(_hf({"quant_method": "fp8", "activation_scheme": "static"}))
    assert (per_tensor.activation_scheme, per_tensor.weight_block_size) == ("static", None)
    with pytest.raises(ValueError, match="activation_scheme"):
        checkpoint_quant_spec(_hf({"quant_method": "fp8", "activation_scheme": "weird"}))


def test_unknown_method_names_it_and_the_supported_ones():
    with pytest.raises(ValueError, match=r"'bitsandbytes'.*awq, gptq, fp8"):
        checkpoint_quant_spec(_hf({"quant_method": "bitsandbytes", "load_in_4bit": True}))


def test_no_quantization_config():
    assert checkpoint_quant_spec(SimpleNamespace()) is None
    assert checkpoint_quant_spec(_hf(None)) is None


AWQ = QuantSpec("awq")


@pytest.mark.parametrize("requested,checkpoint,is_gguf,expected", [
    (None, AWQ, False, AWQ),                       # the checkpoint selects the method by itself
    ("awq", AWQ, False, AWQ),
    (None, None, False, None),
    ("none", None, False, None),
    (None, None, True, QuantSpec("gguf")),
    ("gguf", None, True, QuantSpec("gguf")),
    ("none", None, True, None),                    # GGUF dequantized at load
    ("int8", None, False, QuantSpec("int8", bits=8, group_size=-1, zero_point=False)),
    ("fp8", None, False, QuantSpec("fp8", bits=8, group_size=-1, zero_point=False)),
    ("int8", None, True, QuantSpec("int8", bits=8, group_size=-1, zero_point=False)),
])
def test_resolve(requested, checkpoint, is_gguf, expected):
    assert resolve_quantization(requested, checkpoint, is_gguf) == expected


@pytest.mark.parametrize("requested,checkpoint,is_gguf,match", [
    ("gptq", AWQ, False, r"'gptq'.*'awq'"),        # a flag against the checkpoint names both
    ("int8", AWQ, False, r"'int8'.*'awq'"),
    ("none", AWQ, False, r"'none'.*'awq'"),
    ("awq", None, False, "awq"),
    ("gptq", None, True, "GGUF"),
    ("gguf", None, False, "gguf"),
    ("int4", None, False, "quantization must be one of"),
])
def test_resolve_errors(requested, checkpoint, is_gguf, match):
    with pytest.raises(ValueError, match=match):
        resolve_quantization(requested, checkpoint, is_gguf)


def test_choices_are_the_cli_values():
    assert QUANTIZATION_CHOICES == ("none", "gguf", "int8", "fp8", "awq", "gptq")
