"""Phi-3 / Phi-3.5: the fused qkv_proj and gate_up_proj tensors, split per TP rank exactly as Llama's separate
tensors are, and named when missing. (Tiny random checkpoints against HF transformers, longrope's short and
long factors and TP=2 included: test_family_parity.py.)"""
from __future__ import annotations

import pytest
import torch

from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.models.architectures import ARCH_CASES, build
from pagedserve.tests.helpers.parity import model_config


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory) -> str:
    return build(ARCH_CASES["phi3"], str(tmp_path_factory.mktemp("phi3")))


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
    (whose TP=2 logits are tested in test_family_parity), GQA and MHA."""
    phi3 = build(ARCH_CASES["phi3"], str(tmp_path / "phi3"), num_key_value_heads=kv_heads)
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
