"""Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE): router, grouped reference, loading and TP shards of
the experts. (Tiny random checkpoints against HF transformers, TP=2 included: test_family_parity.py.)"""
from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.kernels import torch_moe
from pagedserve.tests.helpers.models.architectures import ARCH_CASES, build
from pagedserve.tests.helpers.parity import model_config


def _make(path, arch: str) -> str:
    return build(ARCH_CASES[arch], str(path))


def dense_moe(x, w13, w2, weights, ids) -> torch.Tensor:
    """Every expert on every token, masked by the routing: the oracle for the grouped op."""
    gate_up = torch.einsum("th,eih->tei", x, w13)
    half = gate_up.shape[-1] // 2
    expert_out = torch.einsum("tei,ehi->teh", F.silu(gate_up[..., :half]) * gate_up[..., half:], w2)
    dense_weights = torch.zeros(x.shape[0], w13.shape[0]).scatter_(1, ids, weights)
    return (expert_out * dense_weights[..., None]).sum(1)


@pytest.mark.parametrize("renormalize", [True, False])
def test_topk_softmax_renormalisation(renormalize):
    logits = torch.randn(9, 6, generator=torch.Generator().manual_seed(0))
    weights, ids = torch_moe.topk_softmax(logits, 2, renormalize)
    probs = torch.softmax(logits, -1)
    assert torch.equal(ids, probs.topk(2, -1).indices)
    want = probs.gather(1, ids)
    if renormalize:
        want = want / want.sum(-1, keepdim=True)
        torch.testing.assert_close(weights.sum(-1), torch.ones(9))
    else:
        assert bool((weights.sum(-1) < 1).all())
    torch.testing.assert_close(weights, want)


def test_grouped_reference_equals_dense_and_skips_unchosen_experts():
    gen = torch.Generator().manual_seed(1)
    tokens, hidden, inter, experts = 13, 16, 8, 5
    x = torch.randn(tokens, hidden, generator=gen)
    w13 = torch.randn(experts, 2 * inter, hidden, generator=gen)
    w2 = torch.randn(experts, hidden, inter, generator=gen)
    weights, ids = torch_moe.topk_softmax(torch.randn(tokens, experts, generator=gen), 2, True)
    want = dense_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(torch_moe.fused_moe(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch_moe.masked_moe(x, w13, w2, weights, ids), want, rtol=1e-5, atol=1e-5)
    # Experts 3 and 4, which no token chose, are never read: NaN weights there leave the output finite.
    ids = torch.stack([torch.randperm(3, generator=gen)[:2] for _ in range(tokens)])
    poisoned13, poisoned2 = w13.clone(), w2.clone()
    poisoned13[3:], poisoned2[3:] = float("nan"), float("nan")
    torch.testing.assert_close(torch_moe.fused_moe(x, poisoned13, poisoned2, weights, ids),
                               dense_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
    assert torch_moe.fused_moe(x[:0], w13, w2, weights[:0], ids[:0]).shape == (0, hidden)


def _stack_experts(src: str, dst: str, block: str, parts: tuple[str, str, str]) -> str:
    """The same checkpoint with each layer's experts stacked as transformers holds them."""
    from safetensors.torch import load_file, save_file
    folder = shutil.copytree(src, dst)
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    experts = cfg.get("num_local_experts") or cfg["num_experts"]
    for layer in range(cfg["num_hidden_layers"]):
        prefix = f"model.layers.{layer}.{block}.experts"
        if f"{prefix}.0.{parts[0]}.weight" not in tensors:
            continue
        per = {part: [tensors.pop(f"{prefix}.{e}.{part}.weight") for e in range(experts)] for part in parts}
        tensors[f"{prefix}.gate_up_proj"] = torch.stack([torch.cat([g, u]) for g, u in zip(per[parts[0]],
                                                                                           per[parts[1]])])
        tensors[f"{prefix}.down_proj"] = torch.stack(per[parts[2]])
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    return folder


@pytest.mark.parametrize("arch,block,parts", [("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
                                              ("qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj"))])
def test_stacked_expert_checkpoint_loads_the_same_weights(tmp_path, arch, block, parts):
    per_expert = _make(tmp_path / "per_expert", arch)
    stacked = _stack_experts(per_expert, str(tmp_path / "stacked"), block, parts)
    for rank, size in ((0, 1), (1, 2)):
        ours = dict(load_model(model_config(stacked), TPGroup(rank, size)).named_parameters())
        ref = dict(load_model(model_config(per_expert), TPGroup(rank, size)).named_parameters())
        assert ours.keys() == ref.keys()
        for name, param in ours.items():
            assert torch.equal(param, ref[name]), f"rank {rank}/{size}: {name}"


def test_expert_tp_shards_split_the_intermediate_dim(tmp_path):
    path = _make(tmp_path / "mixtral", "mixtral")
    from safetensors.torch import load_file
    tensors = load_file(os.path.join(path, "model.safetensors"))
    prefix = "model.layers.1.block_sparse_moe.experts.3"
    for rank in range(2):
        moe = load_model(model_config(path), TPGroup(rank, 2)).model.layers[1].mlp.experts
        rows = slice(16 * rank, 16 * (rank + 1))
        assert torch.equal(moe.w13_weight[3], torch.cat([tensors[f"{prefix}.w1.weight"][rows],
                                                         tensors[f"{prefix}.w3.weight"][rows]]))
        assert torch.equal(moe.w2_weight[3], tensors[f"{prefix}.w2.weight"][:, rows])


def test_missing_expert_weight_is_named(tmp_path):
    from safetensors.torch import load_file, save_file
    folder = _make(tmp_path / "q3", "qwen3_moe")
    tensors = load_file(os.path.join(folder, "model.safetensors"))
    del tensors["model.layers.1.mlp.experts.5.up_proj.weight"]
    save_file(tensors, os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"lacks weights: model\.layers\.1\.mlp\.experts\.5\.up_proj\.weight$"):
        load_model(model_config(folder), TPGroup())


def test_quantized_moe_is_refused_with_one_clear_error(tmp_path):
    import dataclasses
    from pagedserve.common.quantization import QuantSpec
    config = dataclasses.replace(model_config(_make(tmp_path / "mixtral", "mixtral")),
                                 quantization=QuantSpec(method="int8", bits=8, group_size=-1))
    with pytest.raises(ValueError, match="quantized expert weights are not supported"):
        load_model(config, TPGroup())
