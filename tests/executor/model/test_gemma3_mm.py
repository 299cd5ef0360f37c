"""Gemma 3's vision-language model against HF transformers: the loader (each checkpoint layout, the tied head),
each image's features, and every position's logits with images, where the image tokens attend to each other
both ways (AttentionMetadata.visible_until) on sliding and global layers alike; without the widened rows the
logits are HF's causal-only ones, which differ."""
from __future__ import annotations

import shutil
from typing import Any

import pytest
import torch

from pagedserve.executor.model.models.vision.gemma3_mm import Gemma3ForConditionalGeneration
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.kernels.attention.backends import TorchReferenceAttentionBackend
from pagedserve.tests.helpers.parity import hf_class_model, our_model, saved_tensors
from pagedserve.tests.helpers.models.tiny_gemma3 import IMAGE, make_tiny_gemma3
from pagedserve.tests.helpers.models.tiny_models import bind_kv_cache, dense_prefill_metadata
from pagedserve.tests.helpers.models.tiny_vlm import random_image


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    return make_tiny_gemma3(str(tmp_path_factory.mktemp("gemma3")), tie=True)      # tied, as Gemma 3 ships


@pytest.fixture(scope="module")
def ours(folder) -> Gemma3ForConditionalGeneration:
    return our_model(folder)


@pytest.fixture(scope="module")
def hf(folder) -> torch.nn.Module:
    return hf_class_model(folder, "Gemma3ForConditionalGeneration")


@pytest.fixture(scope="module")
def inputs(folder) -> dict[str, torch.Tensor]:
    from transformers import AutoProcessor
    images = [random_image(seed, 40 + 8 * seed, 50) for seed in range(2)]
    text = f"USER: {IMAGE} then {IMAGE}{IMAGE} and some text after\nASSISTANT:"
    return AutoProcessor.from_pretrained(folder)(text=text, images=images + [images[0]], return_tensors="pt")


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _until(token_type_ids: torch.Tensor) -> torch.Tensor:
    """Each token's last visible key: its own position, or its run of image tokens' last (HF's blocks)."""
    types = token_type_ids.tolist()
    until = list(range(len(types)))
    for i in reversed(range(len(types) - 1)):
        if types[i] == 1 and types[i + 1] == 1:
            until[i] = until[i + 1]
    return torch.tensor(until, dtype=torch.int64)


@torch.inference_mode()
def _logits(model: Gemma3ForConditionalGeneration, inputs: dict[str, torch.Tensor], widened: bool,
            backend: Any = None) -> torch.Tensor:
    ids = inputs["input_ids"][0]
    block_size = 8
    num_blocks = -(-len(ids) // block_size)
    bind_kv_cache(model, num_blocks, block_size)
    if backend is not None:
        for layer in model.attention_layers():
            layer.bind_kv_cache(layer.kv_cache, backend)
    embeds = model.embed_input_ids(ids)
    embeds[ids == model.image_token_id] = torch.cat(model.embed_multimodal(inputs["pixel_values"]))
    meta = dense_prefill_metadata(len(ids), block_size, num_blocks)
    if widened:
        meta.visible_until = _until(inputs["token_type_ids"][0])
    return model.compute_logits(model(ids, torch.arange(len(ids)), meta, inputs_embeds=embeds))


def test_loader_loads_every_expected_weight_with_the_head_tied(ours, folder, hf):
    assert ours.image_token_id == hf.config.image_token_id
    saved = saved_tensors(folder)
    assert "multi_modal_projector.mm_input_projection_weight" in saved and not any("lm_head" in n for n in saved)
    fresh = Gemma3ForConditionalGeneration(hf.config, TPGroup())
    loaded = fresh.load_weights(saved.items())
    assert fresh.expected_weights() - loaded == set() and loaded <= fresh.expected_weights()
    assert all(torch.equal(p, _state(ours)[n]) for n, p in _state(fresh).items())


def test_every_checkpoint_layout_loads_the_same_weights(ours, folder, hf, tmp_path):
    from safetensors.torch import save_file
    classic = tmp_path / "classic"          # the hub's: SigLIP nested under vision_model
    shutil.copytree(folder, classic)
    save_file({n.replace("vision_tower.", "vision_tower.vision_model.", 1): t for n, t in saved_tensors(folder).items()},
              str(classic / "model.safetensors"))
    in_memory = Gemma3ForConditionalGeneration(hf.config, TPGroup())      # transformers 5's module names
    state = hf.state_dict()
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in state
    assert in_memory.expected_weights() - in_memory.load_weights(state.items()) == set()
    want = _state(ours)
    for model in (our_model(str(classic)), in_memory):
        got = _state(model)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_image_features_match_hf(ours, hf, inputs):
    with torch.inference_mode():
        want = hf.get_image_features(pixel_values=inputs["pixel_values"]).pooler_output
        got = ours.embed_multimodal(inputs["pixel_values"])
    assert len(got) == 3 and got[0].shape == (16, 64)
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("backend", [None, TorchReferenceAttentionBackend], ids=["cpu", "reference"])
def test_logits_match_hf_only_with_image_tokens_attending_both_ways(ours, hf, inputs, backend):
    """Three images (two adjacent: separate blocks, as HF's runs are), a window of 8 shorter than an image."""
    with torch.inference_mode():
        want = hf(**inputs).logits[0]
        causal = hf(**{k: v for k, v in inputs.items() if k != "token_type_ids"}).logits[0]
    assert (want - causal).abs().max() > 0.1            # the mask matters on this model
    torch.testing.assert_close(_logits(ours, inputs, True, backend), want, atol=1e-4, rtol=0)
    torch.testing.assert_close(_logits(ours, inputs, False, backend), causal, atol=1e-4, rtol=0)
