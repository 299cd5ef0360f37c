"""`model.load_weights(weights=[(name, tensor), ...])` called directly, as TRL's, OpenRLHF's and verl's worker
extensions call it through collective_rpc: a batch with one bad tensor at its end (a wrong shape, an unknown
name) is refused naming it and leaves every weight bitwise as it was; a valid batch, given as a generator,
still applies. Through a real engine at TP=1 and TP=2 (gloo worker processes), and on every model class."""
from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable

import pytest
import torch
from safetensors.torch import load_file

from pagedserve.common.quantization import resolve_quantization
from pagedserve.common.speculative import mark_eagle_head
from pagedserve.executor.model.model_loader import load_model
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.executor.model.quant.loading import packed_tensors
from pagedserve.frontend.offline.llm import LLM
from pagedserve.tests.helpers.models.architectures import GEMMA2, MOE, PHI3
from pagedserve.tests.helpers.parity import hf_model, model_config
from pagedserve.tests.helpers.models.pooling_models import make_causal_classifier, make_cross_encoder
from pagedserve.tests.helpers.rl.rl_extension import BAD_SHAPE, UNKNOWN, checkpoint_batch, weights_digest
from pagedserve.tests.helpers.models.tiny_models import hf_greedy, make_tiny_eagle_head, make_tiny_model
from pagedserve.tests.helpers.rl.weight_update_cases import NEW_TOKENS, PROMPTS, greedy

EXTENSION = "pagedserve.tests.helpers.rl.rl_extension.Probe"


@pytest.mark.parametrize("tp", [1, 2], ids=["tp1", "tp2"])
def test_extension_load_weights_refuses_a_bad_batch_whole(update_checkpoints, tp) -> None:
    a, b = update_checkpoints
    want_b = hf_greedy(hf_model(b), PROMPTS, NEW_TOKENS)
    with LLM(a, dtype="float32", tensor_parallel_size=tp, worker_extension_cls=EXTENSION) as llm:
        before, digests = greedy(llm), llm.collective_rpc("rank_weights_digest")
        assert len(set(digests)) == tp                     # each rank hashes its own shard
        # b's tensors, valid up to the last one: copied as they came, most of the model would be b's
        for change, named in (("shape", rf"{re.escape(BAD_SHAPE)}.*\(64, 136\).*\(64, 128\)"),
                              ("name", re.escape(UNKNOWN))):
            for method in ("load_checkpoint_weights", "update_checkpoint_weights"):
                with pytest.raises(ValueError, match=named):
                    llm.collective_rpc(method, args=(b, change))
                assert llm.collective_rpc("rank_weights_digest") == digests
            assert greedy(llm) == before
        assert llm.collective_rpc("load_checkpoint_weights", args=(b,)) == [len(checkpoint_batch(b))] * tp
        assert greedy(llm) == want_b != before
        assert llm.collective_rpc("rank_weights_digest") != digests


# ---------------------------------------------------------------- every model class, on one rank

def _tiny(arch: str, **fields) -> Callable[[str, int], str]:
    return lambda path, seed: make_tiny_model(path, arch=arch, tokenizer="synthetic", seed=seed, **fields)


def _eagle(method: str) -> Callable[[str, int], str]:
    def make(path: str, seed: int) -> str:
        # Eight layers: EAGLE-3 reads layers 2, 4 and 5.
        target = make_tiny_model(f"{path}_target", tokenizer="synthetic", num_hidden_layers=8)
        return make_tiny_eagle_head(path, target, method, seed=seed, draft_vocab_size=300 if method == "eagle3" else None)
    return make


CLASSES = {
    "phi3": _tiny("phi3", **PHI3), "gemma2": _tiny("gemma2", **GEMMA2), "mixtral": _tiny("mixtral", **MOE["mixtral"]),
    "qwen2_moe": _tiny("qwen2_moe", **MOE["qwen2_moe"]),
    "bert_cross_encoder": lambda path, seed: make_cross_encoder(path, seed=seed),
    "qwen2_classifier": lambda path, seed: make_causal_classifier(path, seed=seed),
    "eagle": _eagle("eagle"), "eagle3": _eagle("eagle3"),
}


def _load(path: str, arch: str) -> torch.nn.Module:
    config = model_config(path)
    if arch.startswith("eagle"):
        mark_eagle_head(config.hf_config, arch, model_config(f"{path}_target").hf_config)
    return load_model(config, TPGroup(), pooling=arch in ("bert_cross_encoder", "qwen2_classifier"))


def _tensors(path: str) -> list[tuple[str, torch.Tensor]]:
    return sorted(load_file(os.path.join(path, "model.safetensors")).items())


def _wrong_shape_last(tensors: list[tuple[str, torch.Tensor]]) -> tuple[str, list[tuple[str, torch.Tensor]]]:
    """The last matrix in name order moved to the end, one column wider."""
    bad, t = [(n, t) for n, t in tensors if t.dim() == 2][-1]
    return bad, [(n, x) for n, x in tensors if n != bad] + [(bad, torch.cat((t, t[:, :1]), 1))]


@pytest.mark.parametrize("arch", list(CLASSES))
def test_every_model_class_checks_the_whole_batch(tmp_path, arch) -> None:
    a, b = (CLASSES[arch](str(tmp_path / name), seed) for name, seed in (("a", 0), ("b", 1)))
    model, tensors = _load(a, arch), _tensors(b)
    digest = weights_digest(model)
    bad, batch = _wrong_shape_last(tensors)
    with pytest.raises(ValueError, match=re.escape(bad)):
        model.load_weights(item for item in batch)
    assert weights_digest(model) == digest
    if not arch.startswith("bert"):          # the encoder skips names it has no parameter for (HF heads)
        with pytest.raises(ValueError, match=r"mlp\.surprise\.weight"):
            model.load_weights(tensors + [("model.layers.0.mlp.surprise.weight", torch.zeros(4, 4))])
        assert weights_digest(model) == digest
    model.load_weights(item for item in tensors)
    assert weights_digest(model) != digest
    fresh = dict(_load(b, arch).named_parameters())
    for name, p in model.named_parameters():
        if not (arch == "qwen2_classifier" and name.startswith("lm_head.")):    # never loaded (pooling)
            assert torch.equal(p, fresh[name]), name


def test_quantized_model_refuses_load_weights_before_any_copy(update_checkpoints) -> None:
    a, b = update_checkpoints
    int8 = resolve_quantization("int8", None, is_gguf=False)
    model = load_model(dataclasses.replace(model_config(a), quantization=int8), TPGroup())
    digest, packed = weights_digest(model), [t.clone() for t in packed_tensors(model)]
    with pytest.raises(ValueError, match=r"quantized.*update_weights"):
        model.load_weights(checkpoint_batch(b))
    assert weights_digest(model) == digest
    assert all(torch.equal(t, old) for t, old in zip(packed_tensors(model), packed, strict=True))
