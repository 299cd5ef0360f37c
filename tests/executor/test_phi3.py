"""Phi-3 / Phi-3.5 (fused qkv_proj and gate_up_proj, longrope): tiny random models against HF transformers."""
from __future__ import annotations

import pytest
import torch

from pagedserve import LLM, SamplingParams
from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.tiny_models import hf_greedy, make_tiny_model, prefill_logits, random_prompts
from pagedserve.tests.executor.test_model import hf_model, model_config

NEW_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS)
ORIGINAL = 64
# head_dim 16 -> 8 per-dimension factors, distinct so that short/long or a shift would show.
LONGROPE = {"type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
            "long_factor": [1.1, 1.5, 2.2, 3.4, 5.1, 7.7, 11.3, 16.9]}


def _make(path, **overrides) -> str:
    return make_tiny_model(str(path), arch="phi3", tokenizer="synthetic", sliding_window=None, pad_token_id=0,
                           **overrides)


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> str:
    return _make(tmp_path_factory.mktemp("phi3"), max_position_embeddings=512)


@pytest.fixture(scope="module")
def longrope_dir(tmp_path_factory) -> str:
    return _make(tmp_path_factory.mktemp("phi3_longrope"), max_position_embeddings=4 * ORIGINAL,
                 original_max_position_embeddings=ORIGINAL, rope_scaling=dict(LONGROPE))


def shared_prefix(vocab: int, base_len: int, tails: list[int]) -> list[list[int]]:
    base = random_prompts(7, [base_len], vocab, low=3)[0]
    return [base + tail for tail in random_prompts(8, tails, vocab, low=3)]


def check_engine(path: str, prompts: list[list[int]], shared: list[list[int]], **engine) -> None:
    """Greedy tokens equal HF generate under chunked prefill (32-token chunks), then with prefix-cache hits."""
    hf = hf_model(path)
    want, want_shared = hf_greedy(hf, prompts, NEW_TOKENS), hf_greedy(hf, shared, NEW_TOKENS)
    llm = LLM(path, dtype="float32", max_num_batched_tokens=32, **engine)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, GREEDY, use_tqdm=False)] == want
    assert llm.generate(shared[:1], GREEDY, use_tqdm=False)[0].outputs[0].token_ids == want_shared[0]
    hits = llm.engine.kv_cache_manager.prefix_stats.hits
    got = [o.outputs[0].token_ids for o in llm.generate(shared[1:], GREEDY, use_tqdm=False)]
    assert got == want_shared[1:]
    assert llm.engine.kv_cache_manager.prefix_stats.hits - hits >= (len(shared) - 1) * 32   # >= 2 blocks each


def test_phi3_logits_match_hf(phi3_dir):
    ours = load_model(model_config(phi3_dir), TPGroup())
    prompt = random_prompts(11, [40], 512, low=3)[0]
    with torch.inference_mode():
        expected = hf_model(phi3_dir)(torch.tensor([prompt])).logits[0]
    torch.testing.assert_close(prefill_logits(ours, prompt), expected, atol=1e-4, rtol=0)


def test_phi3_engine_matches_hf_generate(phi3_dir):
    check_engine(phi3_dir, random_prompts(1, [10, 47, 90, 130], 512, low=3),
                 shared_prefix(512, 40, [5, 17, 30]))


def test_phi3_longrope_long_factors_match_hf_generate(longrope_dir):
    """max_model_len 256 > 64: long factors everywhere, which HF uses for every prompt longer than 64."""
    check_engine(longrope_dir, random_prompts(2, [65, 90, 150], 512, low=3),
                 shared_prefix(512, 70, [3, 20, 41]))


def test_phi3_longrope_short_factors_match_hf_generate(longrope_dir):
    """max_model_len 64: short factors, which HF uses while prompt + output stays within 64 tokens."""
    check_engine(longrope_dir, random_prompts(3, [10, 25, 40], 512, low=3),
                 shared_prefix(512, 33, [1, 4, 7]), max_model_len=ORIGINAL)


def _unfuse_as_llama(phi3_path: str, out: str) -> str:
    """The same weights as a Llama checkpoint (separate q/k/v and gate/up tensors)."""
    import json
    import os
    from safetensors.torch import load_file, save_file
    with open(os.path.join(phi3_path, "config.json")) as f:
        cfg = json.load(f)
    tensors = load_file(os.path.join(phi3_path, "model.safetensors"))
    q, kv = cfg["num_attention_heads"] * 16, cfg["num_key_value_heads"] * 16
    split = {}
    for name, t in tensors.items():
        if name.endswith("qkv_proj.weight"):
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), t.split([q, kv, kv])):
                split[name.replace("qkv_proj", part)] = piece.contiguous()
        elif name.endswith("gate_up_proj.weight"):
            for part, piece in zip(("gate_proj", "up_proj"), t.chunk(2)):
                split[name.replace("gate_up_proj", part)] = piece.contiguous()
        else:
            split[name] = t
    os.makedirs(out)
    save_file(split, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg.update(architectures=["LlamaForCausalLM"], model_type="llama")
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f)
    return out


@pytest.mark.parametrize("kv_heads", [2, 4])
def test_phi3_tp_shards_equal_llamas(tmp_path, kv_heads):
    """On each of 2 ranks, the split fused tensors give exactly the shards Llama's separate tensors give
    (whose TP=2 logits are tested in test_model), GQA and MHA."""
    phi3 = _make(tmp_path / "phi3", num_key_value_heads=kv_heads)
    llama = _unfuse_as_llama(phi3, str(tmp_path / "llama"))
    for rank in range(2):
        ours = dict(load_model(model_config(phi3), TPGroup(rank, 2)).named_parameters())
        ref = dict(load_model(model_config(llama), TPGroup(rank, 2)).named_parameters())
        assert ours.keys() == ref.keys()
        for name, param in ours.items():
            assert torch.equal(param, ref[name]), f"rank {rank}: {name}"
        assert ours["model.layers.0.self_attn.qkv_proj.weight"].shape[0] == (4 + 2 * kv_heads) * 16 // 2


def test_phi3_missing_fused_weight_is_named(phi3_dir, tmp_path):
    import os
    import shutil
    from safetensors.torch import load_file, save_file
    folder = shutil.copytree(phi3_dir, str(tmp_path / "missing"))
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors["model.layers.1.mlp.gate_up_proj.weight"]
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights: model\.layers\.1\.mlp\.gate_up_proj\.weight$"):
        load_model(model_config(folder), TPGroup())
