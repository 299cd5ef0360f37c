"""scripts/make_padded_target.py (issue 26's draft_model target): appended layers with zero o_proj/down_proj
leave the function unchanged (HF transformers, float, prefill and cached decode), and llama.cpp's converter and
quantizer keep them as real layers whose output projections stay zero."""
from __future__ import annotations

import os
import pathlib

import numpy as np
import pytest
import torch

from pagedserve.common import envs
from pagedserve.tests.helpers.tiny_models import embedded_tokenizer, make_tiny_model

SCRIPTS = pathlib.Path(__file__).resolve().parents[4] / "scripts"
REAL, EXTRA = 2, 3
LLAMA_BIN = os.path.join(envs.PAGEDSERVE_LLAMA_CPP_DIR, "build", "bin")
LLAMA_SRC = os.path.join(envs.PAGEDSERVE_LLAMA_CPP_DIR, "src")


@pytest.fixture()
def script(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    import make_padded_target
    return make_padded_target


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny") / "hf"), arch="llama", num_hidden_layers=REAL,
                           vocab_size=49152, seed=3)


def _load(path: str):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@torch.no_grad()
def _logits(model, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(prefill logits of ids[:, :-2], then the last two tokens' logits decoded against the KV cache)."""
    first = model(ids[:, :-2], use_cache=True)
    return first.logits, model(ids[:, -2:], past_key_values=first.past_key_values).logits


IDS = torch.tensor([[1, 504, 3145, 28, 17, 9000, 42, 30111, 7]])


def test_padding_is_the_identity(script, tiny_hf):
    reference = _logits(_load(tiny_hf), IDS)
    model = script.pad_layers(_load(tiny_hf), EXTRA)
    assert len(model.model.layers) == model.config.num_hidden_layers == REAL + EXTRA
    extra = model.model.layers[REAL]
    assert extra.self_attn.q_proj.weight.abs().sum() > 0 and extra.mlp.up_proj.weight.abs().sum() > 0  # real work
    assert extra.self_attn.o_proj.weight.abs().sum() == 0 and extra.mlp.down_proj.weight.abs().sum() == 0
    for got, want in zip(_logits(model, IDS), reference):
        assert (got - want).abs().max().item() <= 1e-5
    # The check has teeth: the same copy with its down_proj restored changes the output.
    with torch.no_grad():
        extra.mlp.down_proj.weight.copy_(model.model.layers[0].mlp.down_proj.weight)
    assert (_logits(model, IDS)[0] - reference[0]).abs().max().item() > 1e-3


def test_saved_padded_folder_is_the_identity(script, tiny_hf, tmp_path):
    """What the converter reads: the bf16 folder save_padded writes, reloaded, against the bf16 original."""
    folder = str(tmp_path / "padded")
    script.save_padded(_load(tiny_hf), embedded_tokenizer(), folder, EXTRA)
    padded = _load(folder)
    assert padded.config.num_hidden_layers == REAL + EXTRA
    _load(tiny_hf).to(torch.bfloat16).save_pretrained(tmp_path / "bf16")   # the same rounding, unpadded
    reference = _logits(_load(str(tmp_path / "bf16")), IDS)
    for got, want in zip(_logits(padded, IDS), reference):
        assert (got - want).abs().max().item() <= 1e-5


@pytest.mark.skipif(not (os.access(os.path.join(LLAMA_BIN, "llama-quantize"), os.X_OK)
                         and os.path.isfile(os.path.join(LLAMA_SRC, "convert_hf_to_gguf.py"))),
                    reason="no llama.cpp converter/quantizer built (scripts/build_llama_server.sh)")
def test_llama_cpp_keeps_the_padding(script, tiny_hf, tmp_path):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    folder, bf16, q8 = str(tmp_path / "hf"), str(tmp_path / "p-bf16.gguf"), str(tmp_path / "p-Q8_0.gguf")
    script.save_padded(_load(tiny_hf), embedded_tokenizer(), folder, EXTRA)
    script.lm.convert_bf16(LLAMA_SRC, folder, bf16)
    script.lm.quantize(os.path.join(LLAMA_BIN, "llama-quantize"), bf16, q8, "Q8_0", 1)
    reader = GGUFReader(q8)
    assert int(reader.fields["llama.block_count"].contents()) == REAL + EXTRA
    assert "<|im_start|>" in reader.fields["tokenizer.chat_template"].contents()   # the embedded chat template
    tensors = {t.name: dequantize(np.array(t.data), t.tensor_type) for t in reader.tensors}
    for i in range(REAL, REAL + EXTRA):
        src = i % REAL
        for name in ("attn_output", "ffn_down"):
            assert not tensors[f"blk.{i}.{name}.weight"].any()
        for name in ("attn_q", "attn_k", "attn_v", "ffn_gate", "ffn_up", "attn_norm", "ffn_norm"):
            np.testing.assert_array_equal(tensors[f"blk.{i}.{name}.weight"], tensors[f"blk.{src}.{name}.weight"])
