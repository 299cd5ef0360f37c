"""Llava (CLIP tower + projector + Llama) against HF transformers on a tiny random checkpoint: the image
features, the logits at every position of prompts with one and two images (features merged at the
placeholders as the runner merges them), the three checkpoint layouts, and the feature-layer options."""
from __future__ import annotations

import shutil
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from pagedserve.executor.model.models.vision.llava import LlavaForConditionalGeneration
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.parity import hf_class_model, our_model, saved_tensors
from pagedserve.tests.helpers.models.tiny_models import bind_kv_cache, dense_prefill_metadata
from pagedserve.tests.helpers.models.tiny_vlm import make_tiny_llava, random_image


@pytest.fixture(scope="module")
def llava_dir(tmp_path_factory) -> str:
    return make_tiny_llava(str(tmp_path_factory.mktemp("tiny_llava")))


@pytest.fixture(scope="module")
def ours(llava_dir) -> LlavaForConditionalGeneration:
    return our_model(llava_dir)


@pytest.fixture(scope="module")
def hf(llava_dir) -> torch.nn.Module:
    return hf_class_model(llava_dir, "LlavaForConditionalGeneration")


@pytest.fixture(scope="module")
def processor(llava_dir: str) -> Any:
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(llava_dir)


def _classic(name: str) -> str:
    """The hub's llava-hf name of a transformers 5 saved one (CLIP nested under vision_model)."""
    return name.replace("vision_tower.", "vision_tower.vision_model.", 1)


def _inputs(processor: Any, n_images: int) -> dict[str, torch.Tensor]:
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": "Describe these."}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    images = [random_image(seed, 40 + 8 * seed, 50) for seed in range(n_images)]
    return processor(images=images, text=text, return_tensors="pt")


@torch.inference_mode()
def _merged_logits(model: LlavaForConditionalGeneration, ids: torch.Tensor, pixels: torch.Tensor) -> torch.Tensor:
    """One dense prefill with the image features in place of the placeholders' embeddings."""
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    bind_kv_cache(model, num_blocks, block_size)
    embeds = model.embed_input_ids(ids)
    embeds[ids == model.image_token_id] = torch.cat(model.embed_multimodal(pixels))
    hidden = model(ids, torch.arange(len(ids)), dense_prefill_metadata(len(ids), block_size, num_blocks),
                   inputs_embeds=embeds)
    return model.compute_logits(hidden)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_loader_loads_every_expected_weight(ours, llava_dir, hf):
    assert type(ours).__name__ == "LlavaForConditionalGeneration"
    assert ours.image_token_id == hf.config.image_token_id
    assert ours.vision_tower.num_layers == 1        # feature layer -2 of 2: the last layer is never built
    fresh = LlavaForConditionalGeneration(hf.config, TPGroup())
    loaded = fresh.load_weights(saved_tensors(llava_dir).items())
    assert fresh.expected_weights() - loaded == set()
    assert loaded <= fresh.expected_weights()
    assert all(torch.equal(p, _state(ours)[n]) for n, p in _state(fresh).items())


def test_image_features_match_hf(ours, hf, processor):
    pixels = _inputs(processor, 2)["pixel_values"]
    with torch.inference_mode():
        want = hf.get_image_features(pixel_values=pixels).pooler_output
        got = ours.embed_multimodal(pixels)
    assert len(got) == 2 and got[0].shape == (16, 64) and got[0].dtype == torch.float32
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_with_images_match_hf(ours, hf, processor, n_images):
    inputs = _inputs(processor, n_images)
    ids = inputs["input_ids"][0]
    assert int((ids == ours.image_token_id).sum()) == 16 * n_images
    with torch.inference_mode():
        want = hf(**inputs).logits[0]
    got = _merged_logits(ours, ids, inputs["pixel_values"])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_every_checkpoint_layout_loads_the_same_weights(ours, llava_dir, hf, tmp_path):
    saved = saved_tensors(llava_dir)
    classic = tmp_path / "classic"
    shutil.copytree(llava_dir, classic)
    from safetensors.torch import save_file
    save_file({_classic(n): t for n, t in saved.items()}, str(classic / "model.safetensors"))
    assert any(n.startswith("vision_tower.vision_model.") for n in saved_tensors(str(classic)))
    want = _state(ours)
    for_classic = our_model(str(classic))
    in_memory = LlavaForConditionalGeneration(hf.config, TPGroup())     # transformers 5's own module names
    state = hf.state_dict()
    assert "model.language_model.layers.0.self_attn.q_proj.weight" in state and "lm_head.weight" in state
    assert in_memory.expected_weights() - in_memory.load_weights(state.items()) == set()
    for model in (for_classic, in_memory):
        got = _state(model)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


@pytest.mark.parametrize("feature_layer,strategy", [(-1, "full"), ([0, -1], "default"), ([-2, -1], "full")])
def test_feature_layers_and_strategy_match_hf(llava_dir, processor, feature_layer, strategy):
    from transformers import AutoConfig
    from transformers import LlavaForConditionalGeneration as HFLlava
    config = AutoConfig.from_pretrained(llava_dir)
    config.vision_feature_layer, config.vision_feature_select_strategy = feature_layer, strategy
    torch.manual_seed(3)
    theirs = HFLlava(config).eval()
    mine = LlavaForConditionalGeneration(config, TPGroup())
    mine.load_weights(theirs.state_dict().items())
    pixels = _inputs(processor, 2)["pixel_values"]
    with torch.inference_mode():
        want = theirs.get_image_features(pixel_values=pixels).pooler_output
        got = mine.embed_multimodal(pixels)
    assert got[0].shape[0] == 16 + (strategy == "full")
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


def test_bad_configs_and_tensors_name_what_is_wrong(hf):
    # transformers' own LlavaConfig refuses these values: a plain namespace carries them
    fields = {k: getattr(hf.config, k) for k in ("text_config", "vision_config", "image_token_id",
                                                  "projector_hidden_act", "multimodal_projector_bias")}
    bad_strategy = SimpleNamespace(**fields, vision_feature_layer=-2, vision_feature_select_strategy="pooled")
    with pytest.raises(ValueError, match="vision_feature_select_strategy: 'pooled'"):
        LlavaForConditionalGeneration(bad_strategy, TPGroup())
    bad_layer = SimpleNamespace(**fields, vision_feature_layer=5, vision_feature_select_strategy="default")
    with pytest.raises(ValueError, match="vision_feature_layer: 5"):
        LlavaForConditionalGeneration(bad_layer, TPGroup())
    model = LlavaForConditionalGeneration(hf.config, TPGroup())
    with pytest.raises(ValueError, match="vision_tower.encoder.layers.7.mlp.fc1.weight"):
        model.load_weights([("vision_tower.encoder.layers.7.mlp.fc1.weight", torch.zeros(64, 32))])
    with pytest.raises(ValueError, match=r"language_model.model.layers.0.mlp.down_proj.weight"):
        model.load_weights([("language_model.model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="pixel_values"):
        model.embed_multimodal(torch.zeros(1, 3, 48, 48))
