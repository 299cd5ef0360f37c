"""Model loading: the embedded SmolLM2's GGUF weights and logits against HF's GGUF load, QKV shards per TP rank,
loader errors, GGUF reading details, the CPU KV cache's residency. (Every family's tiny checkpoint against HF,
TP=2 included: test_family_parity.py.)"""
from __future__ import annotations

import json
import os

import pytest
import torch

from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.models import get_model_class
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.parity import model_config
from pagedserve.tests.helpers.models.tiny_models import make_tiny_model, prefill_logits, random_prompts

# ---------------------------------------------------------------- SmolLM2 (GGUF)


@pytest.fixture(scope="module")
def our_smollm2(smollm2_path):
    return load_model(model_config(smollm2_path), TPGroup())


def _split_qkv(model: torch.nn.Module, layer: int) -> tuple[torch.Tensor, ...]:
    attn = model.model.layers[layer].self_attn
    return attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])


@pytest.mark.slow
@pytest.mark.parametrize("layer", [0, 17, 29])
def test_smollm2_weights_equal_hf_gguf(our_smollm2, hf_smollm2, layer):
    ours, hf = our_smollm2, hf_smollm2
    hf_layer, our_layer = hf.model.layers[layer], ours.model.layers[layer]
    q, k, v = _split_qkv(ours, layer)
    gate, up = our_layer.mlp.gate_up_proj.weight.chunk(2)
    pairs = {
        "q_proj": (q, hf_layer.self_attn.q_proj.weight), "k_proj": (k, hf_layer.self_attn.k_proj.weight),
        "v_proj": (v, hf_layer.self_attn.v_proj.weight), "o_proj": (our_layer.self_attn.o_proj.weight,
                                                                    hf_layer.self_attn.o_proj.weight),
        "gate_proj": (gate, hf_layer.mlp.gate_proj.weight), "up_proj": (up, hf_layer.mlp.up_proj.weight),
        "down_proj": (our_layer.mlp.down_proj.weight, hf_layer.mlp.down_proj.weight),
        "input_layernorm": (our_layer.input_layernorm.weight, hf_layer.input_layernorm.weight),
        "embed_tokens": (ours.model.embed_tokens.weight, hf.model.embed_tokens.weight),
        "norm": (ours.model.norm.weight, hf.model.norm.weight),
        "lm_head": (ours.lm_head.weight, hf.lm_head.weight),
    }
    for name, (mine, theirs) in pairs.items():
        assert torch.equal(mine, theirs), f"{name} of layer {layer} differs from HF's GGUF load"


@pytest.mark.slow
def test_smollm2_logits_match_hf(our_smollm2, hf_smollm2):
    prompt = random_prompts(5, [48], hf_smollm2.config.vocab_size, low=100)[0]
    with torch.inference_mode():
        expected = hf_smollm2(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(our_smollm2, prompt), expected, atol=1e-3, rtol=0)


# ---------------------------------------------------------------- tensor-parallel shards


@pytest.mark.parametrize("tp_size,kv_heads", [(2, 2), (2, 4), (4, 2), (4, 1)])
def test_qkv_rank_shards(tp_size, kv_heads):
    """Each rank gets its query heads and the KV head(s) those queries attend with (replicated if needed)."""
    from pagedserve.executor.model.layers.linear import QKVParallelLinear
    heads, head_dim, hidden = 4, 3, 5
    full = {s: torch.randn(n * head_dim, hidden) for s, n in (("q", heads), ("k", kv_heads), ("v", kv_heads))}
    for rank in range(tp_size):
        layer = QKVParallelLinear(hidden, head_dim, heads, kv_heads, False, TPGroup(rank, tp_size))
        for shard_id, weight in full.items():
            layer.weight.weight_loader(layer.weight, weight, shard_id)
        q, k, v = layer.weight.split([layer.q_size, layer.kv_size, layer.kv_size])
        q_heads, kv_local = heads // tp_size, max(1, kv_heads // tp_size)
        first_kv = rank * q_heads // (heads // kv_heads)        # KV head of this rank's first query head
        assert torch.equal(q, full["q"][rank * q_heads * head_dim:(rank + 1) * q_heads * head_dim])
        assert torch.equal(k, full["k"][first_kv * head_dim:(first_kv + kv_local) * head_dim])
        assert torch.equal(v, full["v"][first_kv * head_dim:(first_kv + kv_local) * head_dim])


# ---------------------------------------------------------------- loader errors


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> str:
    return make_tiny_model(str(tmp_path_factory.mktemp("tiny_errors")), arch="llama")


def _copy_model(src: str, dst: str) -> str:
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_missing_weight_is_named(tiny_dir, tmp_path):
    from safetensors.torch import load_file, save_file
    folder = _copy_model(tiny_dir, str(tmp_path / "missing"))
    weights_file = os.path.join(folder, "model.safetensors")
    tensors = load_file(weights_file)
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        del tensors[name]
    save_file(tensors, weights_file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight") as err:
        load_model(model_config(folder), TPGroup())
    assert "model.layers.1.self_attn.k_proj.weight" in str(err.value)


def test_unknown_architecture(tiny_dir, tmp_path):
    folder = _copy_model(tiny_dir, str(tmp_path / "unknown"))
    config_file = os.path.join(folder, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config["architectures"] = ["FancyNewForCausalLM"]
    with open(config_file, "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match="FancyNewForCausalLM.*LlamaForCausalLM"):
        load_model(model_config(folder), TPGroup())


def test_unknown_model_type_without_architectures():
    from types import SimpleNamespace
    with pytest.raises(ValueError, match="gpt2"):
        get_model_class(SimpleNamespace(architectures=None, model_type="gpt2"))


def test_load_restores_default_dtype(tiny_dir):
    before = torch.get_default_dtype()
    model = load_model(model_config(tiny_dir, dtype="bfloat16"), TPGroup())
    assert torch.get_default_dtype() == before
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert not model.training


# ---------------------------------------------------------------- GGUF reading details


def test_gguf_tensor_reader_matches_stock_reader(tmp_path):
    """Our reader steps over metadata arrays (strings, nested) yet finds the same tensors and scalars as gguf's,
    and the arrays' lengths."""
    import gguf
    import numpy as np
    from pagedserve.common.model.gguf_metadata import gguf_array_length, gguf_field, gguf_reader
    path = str(tmp_path / "synthetic.gguf")
    writer = gguf.GGUFWriter(path, "llama")
    writer.add_string("general.name", "synthetic")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bb", "", "caf\u00e9"])
    writer.add_array("x.ints", [1, 2, 3])
    writer.add_array("x.nested", [[1, 2], [3]])
    writer.add_array("x.nested_strings", [["a"], ["bc", "d"]])
    writer.add_float32("x.float", 1.5)
    writer.add_bool("x.bool", True)
    writer.add_tensor("a.weight", np.arange(32, dtype=np.float32).reshape(8, 4))
    writer.add_tensor("b.weight", np.arange(6, dtype=np.float16).reshape(2, 3))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    ours, stock = gguf_reader(path), gguf.GGUFReader(path)
    assert [t.name for t in ours.tensors] == ["a.weight", "b.weight"]
    for mine, theirs in zip(ours.tensors, stock.tensors):
        assert (mine.name, mine.tensor_type, mine.shape.tolist()) == (theirs.name, theirs.tensor_type,
                                                                      theirs.shape.tolist())
        assert np.array_equal(mine.data, theirs.data)
    assert ours.fields["general.name"].contents() == "synthetic"     # scalars are still parsed
    assert (gguf_field(ours, "x.float"), gguf_field(ours, "x.bool"), gguf_field(ours, "x.none", 7)) == (1.5, True, 7)
    for reader in (ours, stock):
        assert [gguf_array_length(reader, k) for k in ("tokenizer.ggml.tokens", "x.ints", "x.nested",
                                                        "x.nested_strings", "x.none")] == [4, 3, 2, 2, None]
    with pytest.raises(ValueError, match="x.ints is an array"):
        gguf_field(ours, "x.ints")
    with pytest.raises(ValueError, match="general.name is not an array"):
        gguf_array_length(ours, "general.name")


def test_reverse_permute_undoes_llama_cpp_permute():
    import numpy as np
    from pagedserve.executor.model.model_loader import reverse_permute

    def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:   # convert_hf_to_gguf.py's permute
        return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    for n_head, rows in ((9, 9 * 64), (3, 3 * 64), (2, 2 * 8)):
        w = np.random.default_rng(0).standard_normal((rows, 5)).astype(np.float32)
        assert np.array_equal(reverse_permute(llama_cpp_permute(w, n_head), n_head), w)


def _rss_mib() -> float:
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmRSS:")).split()[1]) / 1024


def test_cpu_kv_cache_is_resident_only_where_written(tiny_llama_dir):
    """A 1 GiB CPU cache costs resident memory only for the blocks requests write (an anonymous mapping), and
    reads as zeros where nothing was written."""
    from pagedserve import LLM, SamplingParams
    before = _rss_mib()
    with LLM(tiny_llama_dir, kv_cache_memory=1.0, max_model_len=256) as llm:
        caches = llm.engine.executor.worker.runner.kv_caches
        assert sum(c.numel() * c.element_size() for c in caches) > 0.9 * 2 ** 30
        assert _rss_mib() - before < 400, "the whole cache became resident at start"
        out = llm.generate([{"prompt_token_ids": list(range(3, 40))}], SamplingParams(max_tokens=4),
                           use_tqdm=False)
        assert len(out[0].outputs[0].token_ids) == 4
        assert all(float(c[:, -1].abs().sum()) == 0.0 for c in caches)      # the last block: never written
