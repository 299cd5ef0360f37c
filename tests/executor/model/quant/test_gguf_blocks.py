"""GGUF blocks decoded to GroupQuantWeight reproduce gguf's own dequantize exactly, for every supported format.

Exact (not approximate) equality is expected: each fp32 scale/offset is an f16 times a small integer and each
code product fits in fp32's 24-bit mantissa, so scale * q + offset rounds once, as the reference does.
"""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T
from gguf.quants import dequantize, quantize

from pagedserve.common.model.model_files import embedded_model_path
from pagedserve.common.model.gguf_metadata import gguf_reader
from pagedserve.executor.model.model_loader import reverse_permute
from pagedserve.executor.model.quant.gguf_blocks import (GGUF_QUANT_TYPES, decode_gguf_tensor,
                                                         reverse_permute_rows)
from pagedserve.tests.helpers.models.gguf_blocks import random_k_blocks as _random_k_blocks

_EXPECTED = {"Q4_0": (4, 32), "Q4_1": (4, 32), "Q5_0": (5, 32), "Q5_1": (5, 32), "Q8_0": (8, 32), "Q4_K": (4, 32), "Q5_K": (5, 32), "Q6_K": (6, 16)}


def _check_matches_reference(data: np.ndarray, qtype: T, shape: tuple[int, int]) -> None:
    w = decode_gguf_tensor(data, qtype, shape)
    bits, group = _EXPECTED[qtype.name]
    assert (w.bits, w.group_size, tuple(w.shape)) == (bits, group, shape)
    assert w.q.dtype == torch.uint8 and int(w.q.max()) < 2 ** bits
    assert w.scale.dtype == w.offset.dtype == torch.float32
    reference = torch.from_numpy(dequantize(data, qtype).reshape(shape))
    assert torch.equal(w.dequantize(), reference)


@pytest.fixture(scope="module")
def smollm2_tensors() -> dict:
    return {t.name: t for t in gguf_reader(embedded_model_path()).tensors}


def _torch_shape(tensor) -> tuple[int, int]:
    return tuple(int(d) for d in np.flip(tensor.shape))     # GGUF lists dimensions innermost first


# Q5_0/Q5_1: llama-quantize's fallback for Q4_K_M layers whose width is no multiple of 256 (SmolLM2's 576, 960).
@pytest.mark.parametrize("qtype", [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0])
def test_quantizer_blocks_match_gguf_dequantize(qtype):
    rng = np.random.default_rng(int(qtype))
    weights = rng.standard_normal((6, 128)).astype(np.float32) * 0.05
    weights[0, :32] = 0.0                                   # an all-zero block (d == 0)
    weights[1, 32:64] = 3.0                                 # a constant block
    _check_matches_reference(quantize(weights, qtype), qtype, (6, 128))


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q5_K, T.Q6_K])
def test_k_quant_blocks_match_gguf_dequantize(qtype):
    rows, cols = 3, 512
    blocks = _random_k_blocks(qtype, rows * cols // 256, seed=int(qtype))
    _check_matches_reference(blocks.reshape(rows, -1), qtype, (rows, cols))


@pytest.mark.parametrize("name", ["blk.0.attn_q.weight", "blk.3.ffn_down.weight", "blk.29.ffn_gate.weight"])
def test_embedded_model_q4_1_tensors_match(smollm2_tensors, name):
    tensor = smollm2_tensors[name]
    assert tensor.tensor_type == T.Q4_1
    _check_matches_reference(tensor.data, tensor.tensor_type, _torch_shape(tensor))


def test_embedded_model_q8_0_embedding_matches(smollm2_tensors):
    tensor = smollm2_tensors["token_embd.weight"]
    assert tensor.tensor_type == T.Q8_0
    _check_matches_reference(tensor.data[:300], T.Q8_0, (300, _torch_shape(tensor)[1]))
    w = decode_gguf_tensor(tensor.data, T.Q8_0, _torch_shape(tensor))         # the whole 49152 x 576
    rows = [0, 1, 12345, 49151]
    reference = torch.from_numpy(dequantize(tensor.data[rows], T.Q8_0))
    assert torch.equal(w.dequantize()[rows], reference)


def test_every_quantized_tensor_of_the_embedded_model_is_supported(smollm2_tensors):
    kinds = {t.tensor_type.name for t in smollm2_tensors.values() if len(t.shape) == 2}
    assert kinds - {"F32", "F16"} <= set(GGUF_QUANT_TYPES)
    assert set(GGUF_QUANT_TYPES) == set(_EXPECTED)
    assert all(T[name].name == name for name in GGUF_QUANT_TYPES)     # they are ggml's own names


def test_qtype_may_be_given_as_id_or_name():
    data = quantize(np.linspace(-1, 1, 64, dtype=np.float32).reshape(2, 32), T.Q4_1)
    by_enum = decode_gguf_tensor(data, T.Q4_1, (2, 32)).dequantize()
    assert torch.equal(decode_gguf_tensor(data, int(T.Q4_1), (2, 32)).dequantize(), by_enum)
    assert torch.equal(decode_gguf_tensor(data, "Q4_1", (2, 32)).dequantize(), by_enum)


@pytest.mark.parametrize("layer,proj,heads", [(0, "q", 9), (5, "k", 3)])
def test_reverse_permute_rows_matches_reverse_permute(smollm2_tensors, layer, proj, heads):
    tensor = smollm2_tensors[f"blk.{layer}.attn_{proj}.weight"]
    w = decode_gguf_tensor(tensor.data, tensor.tensor_type, _torch_shape(tensor))
    expected = torch.from_numpy(reverse_permute(w.dequantize().numpy(), heads))
    unpermuted = reverse_permute_rows(w, heads)
    assert not torch.equal(expected, w.dequantize())                   # the permutation moves rows
    assert torch.equal(unpermuted.dequantize(), expected)
    assert (unpermuted.bits, unpermuted.group_size) == (w.bits, w.group_size)


def test_reverse_permute_rows_rejects_rows_that_do_not_split_into_heads():
    w = decode_gguf_tensor(quantize(np.ones((6, 32), np.float32), T.Q8_0), T.Q8_0, (6, 32))
    with pytest.raises(ValueError, match="n_head 2"):
        reverse_permute_rows(w, 2)


@pytest.mark.parametrize("qtype", [T.Q2_K, T.F32, T.IQ4_NL])
def test_unsupported_type_names_itself_and_the_supported_list(qtype):
    with pytest.raises(ValueError) as error:
        decode_gguf_tensor(np.zeros(84, np.uint8), qtype, (1, 256))
    message = str(error.value)
    assert qtype.name in message
    assert all(name in message for name in GGUF_QUANT_TYPES)


def test_wrong_byte_count_or_shape_is_a_value_error():
    data = quantize(np.ones((2, 64), np.float32), T.Q4_0)
    with pytest.raises(ValueError, match="needs 72 bytes, got 36"):
        decode_gguf_tensor(data[:1], T.Q4_0, (2, 64))
    with pytest.raises(ValueError, match="multiple of the 256-weight block"):
        decode_gguf_tensor(np.zeros(144, np.uint8), T.Q4_K, (2, 128))
