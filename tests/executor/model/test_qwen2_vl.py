"""Qwen2-VL and Qwen2.5-VL (dynamic-resolution tower + patch merger + Qwen2 with M-RoPE; 2.5: window attention,
RMSNorm and gated MLPs in the tower) against HF transformers on tiny random checkpoints: the loader in both
layouts, each image's features (alone and batched with another size), the M-RoPE positions against
get_rope_index, the logits at every position of prompts with one and two images of different sizes, text
between and after them, and tokens past the prompt (the delta), and a video's."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from pagedserve.common.multimodal.families import ProcessorSettings, family_of, image_token_id, max_tokens_per_item
from pagedserve.executor.model.models.vision.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration
from pagedserve.executor.model.models.vision.qwen2_vl import Qwen2VLForConditionalGeneration
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.frontend.multimodal.expansion_items import tensor_data
from pagedserve.ipc.messages import MultiModalFeature
from pagedserve.tests.helpers.parity import hf_class_model, our_model
from pagedserve.tests.helpers.models.tiny_models import bind_kv_cache, dense_prefill_metadata
from pagedserve.tests.helpers.models.tiny_qwen2_vl import IMAGE, MAX_PIXELS, VIDEO_SIZE, hf_processor, make_tiny_qwen2_vl
from pagedserve.tests.helpers.models.tiny_vlm import random_image

SIZES = [(40, 30), (24, 56)]        # (w, h): grids 8 x 10 and 14 x 6 patches, 20 and 21 tokens


# version -> (our class, HF's class name)
VERSIONS = {"2": (Qwen2VLForConditionalGeneration, "Qwen2VLForConditionalGeneration"),
            "2.5": (Qwen2_5_VLForConditionalGeneration, "Qwen2_5_VLForConditionalGeneration")}


@pytest.fixture(scope="module", params=list(VERSIONS), ids=["qwen2_vl", "qwen2_5_vl"])
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def qwen_dir(version, tmp_path_factory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("tiny_qwen2_vl")), version=version)


@pytest.fixture(scope="module")
def ours(qwen_dir, version) -> Qwen2VLForConditionalGeneration:
    model = our_model(qwen_dir)
    assert type(model) is VERSIONS[version][0]
    return model


@pytest.fixture(scope="module")
def hf(qwen_dir, version) -> torch.nn.Module:
    return hf_class_model(qwen_dir, VERSIONS[version][1])


@pytest.fixture(scope="module")
def processor(qwen_dir: str) -> Any:
    return hf_processor(qwen_dir)


def _inputs(processor: Any, text: str, n_images: int) -> dict[str, torch.Tensor]:
    images = [random_image(i, w, h) for i, (w, h) in enumerate(SIZES[:n_images])]
    return processor(text=text, images=images or None, return_tensors="pt")


def _features(model: Any, ids: torch.Tensor, grid: torch.Tensor) -> list[MultiModalFeature]:
    """One feature per run of image tokens, with its grid (what the workers' placements carry)."""
    mask = (ids == model.image_token_id).tolist()
    starts = [i for i, m in enumerate(mask) if m and (i == 0 or not mask[i - 1])]
    merge = model.spatial_merge_size ** 2
    return [MultiModalFeature("image", f"h{k}", start, int(grid[k].prod()) // merge,
                              {"image_grid_thw": tensor_data(grid[k:k + 1].numpy())})
            for k, start in enumerate(starts)]


@torch.inference_mode()
def _logits(model: Any, ids: torch.Tensor, positions: torch.Tensor, inputs: dict[str, torch.Tensor]) -> torch.Tensor:
    block_size = 16
    num_blocks = -(-len(ids) // block_size)
    bind_kv_cache(model, num_blocks, block_size)
    embeds = model.embed_input_ids(ids)
    if "pixel_values" in inputs:
        rows = model.embed_multimodal(pixel_values=inputs["pixel_values"], image_grid_thw=inputs["image_grid_thw"])
        embeds[ids == model.image_token_id] = torch.cat(rows)
    hidden = model(ids, positions, dense_prefill_metadata(len(ids), block_size, num_blocks), inputs_embeds=embeds)
    return model.compute_logits(hidden)


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def test_family_facts_match_the_processor(ours, hf, processor, version):
    assert family_of(hf.config) == {"2": "qwen2_vl", "2.5": "qwen2_5_vl"}[version]
    assert image_token_id(hf.config) == ours.image_token_id == processor.image_token_id
    image = processor.image_processor.to_dict()
    # one frame of video (one temporal patch, at most 56 tokens): the image bound is the larger
    most = max_tokens_per_item("qwen2_vl", hf.config, ProcessorSettings(image, {"size": VIDEO_SIZE}, 1))
    assert most == 84           # a factor-high row at the aspect limit: sqrt(200 * 2304 / 64) cells
    # no image the processor makes is larger: squares, and the most elongated it takes
    for w, h in [(4000, 4000), (48, 48), (8, 1600), (1600, 8), (17, 3000)]:
        grid = processor.image_processor(images=[random_image(0, w, h)], return_tensors="np")["image_grid_thw"]
        assert int(grid.prod()) // 4 <= most
    halved = ProcessorSettings({**image, "max_pixels": MAX_PIXELS // 4}, {"size": VIDEO_SIZE}, 1)
    assert max_tokens_per_item("qwen2_vl", hf.config, halved) == 56
    # 32 frames: 16 temporal patches of at most 56 tokens
    assert max_tokens_per_item("qwen2_vl", hf.config, ProcessorSettings(image, {"size": VIDEO_SIZE}, 32)) == 896


def test_loader_loads_every_expected_weight_and_the_hubs_classic_names_load_the_same(ours, hf, version):
    """The real loader read the saved file (`ours`); transformers 5's names and the hub's classic ones load the
    same weights."""
    want = _state(ours)
    modern = {n: t for n, t in hf.state_dict().items() if "rotary" not in n}
    assert any(n.startswith("model.language_model.") for n in modern) and any(n.startswith("model.visual.")
                                                                              for n in modern)
    classic = {("visual." + n[len("model.visual."):] if n.startswith("model.visual.") else
                "model." + n[len("model.language_model."):] if n.startswith("model.language_model.") else n): t
               for n, t in modern.items()}
    for state in (modern, classic):
        model = VERSIONS[version][0](hf.config, TPGroup())
        loaded = model.load_weights(state.items())
        assert model.expected_weights() == loaded == set(modern)
        got = _state(model)
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)


def test_each_images_features_alone_and_batched_match_hfs(ours, hf, processor):
    inputs = _inputs(processor, IMAGE * 2, 2)
    pixels, grid = inputs["pixel_values"], inputs["image_grid_thw"]
    assert grid.tolist() == [[1, 8, 10], [1, 14, 6]]
    with torch.inference_mode():
        want = hf.get_image_features(pixel_values=pixels, image_grid_thw=grid).pooler_output
        batched = ours.embed_multimodal(pixel_values=pixels, image_grid_thw=grid)
        first = int(grid[0].prod())
        alone = [ours.embed_multimodal(pixel_values=pixels[:first], image_grid_thw=grid[:1])[0],
                 ours.embed_multimodal(pixel_values=pixels[first:], image_grid_thw=grid[1:])[0]]
    assert [b.shape for b in batched] == [(20, 64), (21, 64)]
    for k in range(2):
        torch.testing.assert_close(batched[k], want[k], atol=1e-5, rtol=0)
        torch.testing.assert_close(alone[k], want[k], atol=1e-5, rtol=0)


@pytest.mark.parametrize("grids,text_runs", [
    ([(1, 8, 10)], [3, 5]),                      # text, image, text
    ([(1, 8, 10), (1, 14, 6)], [2, 1, 4]),       # two images of different sizes, text between and after
    ([(2, 4, 6), (1, 6, 2)], [1, 3, 0]),         # a two-frame video's grid; the prompt ends with an image
])
def test_mrope_positions_match_hfs_get_rope_index(ours, hf, grids, text_runs):
    ids, types, features = [], [], []
    for k, run in enumerate(text_runs):
        ids += [5] * run
        types += [0] * run
        if k < len(grids):
            t, h, w = grids[k]
            length = t * h * w // 4
            features.append(MultiModalFeature("image", f"h{k}", len(ids), length,
                                              {"image_grid_thw": tensor_data(np.array([grids[k]], dtype=np.int64))}))
            ids += [ours.image_token_id] * length
            types += [1] * length
    want, want_delta = hf.model.get_rope_index(torch.tensor([ids]), torch.tensor([types]),
                                               image_grid_thw=torch.tensor(grids))
    got, delta = ours.mrope_positions(len(ids), features)
    np.testing.assert_array_equal(got, want[:, 0].numpy())
    assert delta == int(want_delta)


@pytest.mark.parametrize("text,n_images", [
    (f"<|im_start|>user\n{IMAGE}describe it<|im_end|>\n<|im_start|>assistant\n", 1),
    (f"<|im_start|>user\ncompare {IMAGE} with {IMAGE} and say which is larger<|im_end|>\n", 2),
])
def test_logits_with_images_match_hf_and_tokens_past_the_prompt_take_the_delta(ours, hf, processor, text, n_images):
    inputs = _inputs(processor, text, n_images)
    prompt = inputs["input_ids"][0]
    extra = torch.tensor([7, 11, 13])            # tokens decoded after the prompt
    ids = torch.cat([prompt, extra])
    features = _features(ours, prompt, inputs["image_grid_thw"])
    rows, delta = ours.mrope_positions(len(prompt), features)
    later = torch.arange(len(prompt), len(ids)) + delta
    positions = torch.cat([torch.from_numpy(rows), later.expand(3, -1)], dim=1)
    full = {**inputs, "input_ids": ids[None], "attention_mask": torch.ones(1, len(ids), dtype=torch.long),
            "mm_token_type_ids": torch.cat([inputs["mm_token_type_ids"][0], torch.zeros(3, dtype=torch.long)])[None]}
    with torch.inference_mode():
        want = hf(**full).logits[0]
    got = _logits(ours, ids, positions, inputs)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("grid", [[2, 4, 6], [3, 2, 4]])        # the second: more frames than rows or columns
def test_a_videos_features_and_logits_match_hf(ours, hf, grid):
    grid = torch.tensor([grid])
    pixels = torch.randn(int(grid.prod()), 96, generator=torch.Generator().manual_seed(0))
    video, length = hf.config.video_token_id, int(grid.prod()) // 4
    ids = torch.tensor([5, 9, 12] + [video] * length + [20, 21, 22, 23])
    with torch.inference_mode():
        want = hf(input_ids=ids[None], pixel_values_videos=pixels, video_grid_thw=grid,
                  mm_token_type_ids=((ids == video).long() * 2)[None]).logits[0]
        features = hf.get_video_features(pixel_values_videos=pixels, video_grid_thw=grid).pooler_output[0]
        rows = ours.embed_multimodal(pixel_values_videos=pixels, video_grid_thw=grid)
    torch.testing.assert_close(rows[0], features, atol=1e-5, rtol=0)
    item = MultiModalFeature("video", "v", 3, length, {"video_grid_thw": tensor_data(grid.numpy())})
    positions, _ = ours.mrope_positions(len(ids), [item])
    block_size, num_blocks = 16, -(-len(ids) // 16)
    bind_kv_cache(ours, num_blocks, block_size)
    with torch.inference_mode():
        embeds = ours.embed_input_ids(ids)
        embeds[ids == video] = rows[0]
        hidden = ours(ids, torch.from_numpy(positions), dense_prefill_metadata(len(ids), block_size, num_blocks),
                      inputs_embeds=embeds)
        got = ours.compute_logits(hidden)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_bad_tensors_name_what_is_wrong(hf, version):
    model = VERSIONS[version][0](hf.config, TPGroup())
    with pytest.raises(ValueError, match="model.visual.blocks.9.attn.qkv.weight"):
        model.load_weights([("model.visual.blocks.9.attn.qkv.weight", torch.zeros(96, 32))])
    with pytest.raises(ValueError, match="model.language_model.layers.0.mlp.down_proj.weight"):
        model.load_weights([("model.language_model.layers.0.mlp.down_proj.weight", torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="pixel_values"):
        model.embed_multimodal(pixel_values=torch.zeros(10, 96), image_grid_thw=torch.tensor([[1, 4, 4]]))
    with pytest.raises(ValueError, match="image_grid_thw"):
        model.embed_multimodal(pixel_values=torch.zeros(12, 96), image_grid_thw=torch.tensor([[1, 3, 4]]))
    with pytest.raises(ValueError, match="pixel_values_videos"):
        model.embed_multimodal()
