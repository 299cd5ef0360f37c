"""Idefics3 (SigLIP-style tower + pixel-shuffle connector + Llama) against HF transformers on a tiny random
checkpoint: the loader, each sub-image's features (encoded alone, batched, and with padding masked), the
logits at every position of prompts with one and two split images, and the bare Idefics3Model's names."""
from __future__ import annotations

from typing import Any

import pytest
import torch

from pagedserve.common.multimodal.families import family_of, image_token_id, max_tokens_per_item
from pagedserve.executor.model.models.vision.idefics3 import Idefics3ForConditionalGeneration
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.tests.helpers.parity import hf_class_model, our_model, saved_tensors
from pagedserve.tests.helpers.models.tiny_models import bind_kv_cache, dense_prefill_metadata
from pagedserve.tests.helpers.models.tiny_vlm import make_tiny_idefics3, random_image

SEQ = 16        # image tokens per sub-image: (32 / 4)^2 patches / 2^2


@pytest.fixture(scope="module")
def idefics_dir(tmp_path_factory) -> str:
    return make_tiny_idefics3(str(tmp_path_factory.mktemp("tiny_idefics3")))


@pytest.fixture(scope="module")
def ours(idefics_dir) -> Idefics3ForConditionalGeneration:
    return our_model(idefics_dir)


@pytest.fixture(scope="module")
def hf(idefics_dir) -> torch.nn.Module:
    return hf_class_model(idefics_dir, "Idefics3ForConditionalGeneration")


@pytest.fixture(scope="module")
def processor(idefics_dir: str) -> Any:
    from transformers import AutoProcessor
    return AutoProcessor.from_pretrained(idefics_dir)


def _inputs(processor: Any, n_images: int) -> dict[str, torch.Tensor]:
    """A chat prompt with n split images: 48x40 (2x2 + global) and 64x20 (1x2 + global)."""
    content = [{"type": "image"} for _ in range(n_images)] + [{"type": "text", "text": "Describe these."}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    images = [random_image(0, 48, 40), random_image(1, 64, 20)][:n_images]
    return processor(images=images, text=text, return_tensors="pt")


def _hf_features(hf: torch.nn.Module, pixels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """HF's connector output for [1, n, 3, H, W] sub-images, as [n, SEQ, hidden]."""
    with torch.inference_mode():
        out = hf.get_image_features(pixel_values=pixels, pixel_attention_mask=mask).pooler_output
    return torch.cat(list(out)).view(pixels.shape[1], SEQ, -1)


@torch.inference_mode()
def _merged_logits(model: Idefics3ForConditionalGeneration, ids: torch.Tensor, pixels: torch.Tensor,
                   mask: torch.Tensor) -> torch.Tensor:
    """One dense prefill with the sub-images' features in place of the placeholders' embeddings."""
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    bind_kv_cache(model, num_blocks, block_size)
    embeds = model.embed_input_ids(ids)
    embeds[ids == model.image_token_id] = torch.cat(model.embed_multimodal(pixels, mask))
    hidden = model(ids, torch.arange(len(ids)), dense_prefill_metadata(len(ids), block_size, num_blocks),
                   inputs_embeds=embeds)
    return model.compute_logits(hidden)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_family_facts_match_the_processor(ours, hf, processor):
    assert family_of(hf.config) == "idefics3"
    assert max_tokens_per_item("idefics3", hf.config, {}) == processor.image_seq_len == SEQ
    assert image_token_id(hf.config) == ours.image_token_id == processor.image_token_id


def test_loader_loads_every_expected_weight(ours, idefics_dir, hf):
    assert type(ours).__name__ == "Idefics3ForConditionalGeneration"
    fresh = Idefics3ForConditionalGeneration(hf.config, TPGroup())
    saved = saved_tensors(idefics_dir)
    loaded = fresh.load_weights(saved.items())
    assert fresh.expected_weights() == loaded == set(saved)
    assert all(torch.equal(p, _state(ours)[n]) for n, p in _state(fresh).items())


def test_the_bare_models_names_and_hfs_in_memory_ones_load_the_same_weights(ours, hf):
    want = _state(ours)
    bare = {n[len("model."):]: t for n, t in hf.state_dict().items() if n.startswith("model.")}
    assert "text_model.layers.0.self_attn.q_proj.weight" in bare
    for state in (hf.state_dict(), {**bare, "lm_head.weight": hf.lm_head.weight}):
        model = Idefics3ForConditionalGeneration(hf.config, TPGroup())
        assert model.expected_weights() - model.load_weights(state.items()) == set()
        got = _state(model)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_each_sub_image_alone_and_batched_matches_hfs_batched_features(ours, hf, processor):
    inputs = _inputs(processor, 2)
    pixels, mask = inputs["pixel_values"], inputs["pixel_attention_mask"]
    assert pixels.shape[:2] == (1, 8)           # 5 + 3 sub-images
    want = _hf_features(hf, pixels, mask)
    with torch.inference_mode():
        batched = ours.embed_multimodal(pixels[0], mask[0])
        alone = [ours.embed_multimodal(pixels[0, k:k + 1], mask[0, k:k + 1])[0] for k in range(8)]
    assert len(batched) == 8 and batched[0].shape == (SEQ, 64) and batched[0].dtype == torch.float32
    for k in range(8):
        torch.testing.assert_close(batched[k], want[k], atol=1e-5, rtol=0)
        torch.testing.assert_close(alone[k], want[k], atol=1e-5, rtol=0)


@pytest.mark.parametrize("rows,cols", [(24, 32), (32, 13), (5, 7)])
def test_a_padded_sub_image_buckets_its_positions_and_masks_its_padding_as_hf(ours, hf, processor, rows, cols):
    pixels = _inputs(processor, 1)["pixel_values"][:, :2]
    mask = torch.zeros(1, 2, 32, 32, dtype=torch.int64)
    mask[0, 0, :rows, :cols] = 1
    mask[0, 1] = 1
    pixels = pixels * mask[:, :, None]          # the processor pads with zeros
    want = _hf_features(hf, pixels, mask)
    with torch.inference_mode():
        got = ours.embed_multimodal(pixels[0], mask[0])
    for mine, theirs in zip(got, want):
        torch.testing.assert_close(mine, theirs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("n_images", [1, 2])
def test_logits_with_images_match_hf(ours, hf, processor, n_images):
    inputs = _inputs(processor, n_images)
    ids = inputs["input_ids"][0]
    assert int((ids == ours.image_token_id).sum()) == SEQ * (5, 8)[n_images - 1]
    with torch.inference_mode():
        want = hf(**inputs).logits[0]
    got = _merged_logits(ours, ids, inputs["pixel_values"][0], inputs["pixel_attention_mask"][0])
    assert got.shape == want.shape
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_bad_tensors_name_what_is_wrong(hf):
    model = Idefics3ForConditionalGeneration(hf.config, TPGroup())
    with pytest.raises(ValueError, match="model.vision_model.encoder.layers.7.mlp.fc1.weight"):
        model.load_weights([("model.vision_model.encoder.layers.7.mlp.fc1.weight", torch.zeros(64, 32))])
    with pytest.raises(ValueError, match="model.connector.modality_projection.proj.weight"):
        model.load_weights([("model.connector.modality_projection.proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="model.text_model.layers.0.mlp.down_proj.weight"):
        model.load_weights([("model.text_model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="pixel_values"):
        model.embed_multimodal(torch.zeros(3, 32, 32))
    with pytest.raises(ValueError, match="pixel_attention_mask"):
        model.embed_multimodal(torch.zeros(2, 3, 32, 32), torch.ones(1, 32, 32))
