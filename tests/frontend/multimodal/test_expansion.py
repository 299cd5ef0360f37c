"""The frontend's per-family expansion against HF's processors: the expanded token ids equal
`processor(text=..., images=...)["input_ids"]`, each item is one run of `<image>` tokens with its own tensors
(Idefics3: one per sub-image, HF's slice of pixel_values), and a repeated image comes from the cache."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedserve.frontend.client.tokenizer import load_tokenizer
from pagedserve.frontend.multimodal.processor import MultiModalProcessor
from pagedserve.ipc.messages import EngineInfo, MultiModalFeature
from pagedserve.tests.helpers.models.tiny_vlm import IMAGE_TOKEN, make_tiny_idefics3, make_tiny_llava, random_image

SIZES = [(48, 40), (64, 20), (10, 90), (200, 30), (33, 33)]     # 2x2, 1x2, 2x1, 1x2, 2x2 grids


def _info(path: str, per_item: int) -> EngineInfo:
    return EngineInfo(served_model_name="tiny", model_path=path, tokenizer=path, max_model_len=4096, vocab_size=0,
                      eos_token_ids=[], max_waiting_requests=None, block_size=16, num_blocks=1,
                      mm_limits={"image": 8}, mm_max_tokens_per_item=per_item)


@pytest.fixture(scope="module", params=["grid_tokens", "grid_as_text", "llava"])
def family(request, tmp_path_factory) -> tuple[str, Any, MultiModalProcessor]:
    from transformers import AutoProcessor
    folder = str(tmp_path_factory.mktemp(request.param))
    if request.param == "llava":
        path, per_item = make_tiny_llava(folder), 16
    else:
        path, per_item = make_tiny_idefics3(folder, grid_tokens=request.param == "grid_tokens"), 16
    ours = MultiModalProcessor(_info(path, per_item), load_tokenizer(path))
    ours.tokenizer = load_tokenizer(path)       # the prompt's, as the input processor tokenizes it
    return request.param, AutoProcessor.from_pretrained(path), ours


def _run(ours: Any, text: str, images: list) -> tuple[list[int], list[MultiModalFeature]]:
    return ours.expand(ours.tokenizer.encode(text), images)


@pytest.mark.parametrize("text,sizes", [
    (f"USER: {IMAGE_TOKEN}describe it\nASSISTANT:", SIZES[:1]),
    (f"USER: compare {IMAGE_TOKEN} and {IMAGE_TOKEN}\nASSISTANT:", SIZES[1:3]),
    (f"{IMAGE_TOKEN}{IMAGE_TOKEN}{IMAGE_TOKEN} three, back to back\n", SIZES[2:]),
])
def test_expanded_ids_equal_hfs_and_each_item_is_one_run_with_its_tensors(family, text, sizes):
    name, hf, ours = family
    images = [random_image(i, w, h) for i, (w, h) in enumerate(sizes)]
    want = hf(text=text, images=images, return_tensors="np")
    ids, features = _run(ours, text, images)
    assert ids == want["input_ids"][0].tolist()
    pixels = want["pixel_values"].reshape(-1, *want["pixel_values"].shape[-3:])
    assert len(features) == len(pixels)             # Llava: one per image; Idefics3: one per sub-image
    covered = set()
    for k, item in enumerate(features):
        assert ids[item.offset:item.offset + item.length] == [ours.image_token_id] * 16
        covered.update(range(item.offset, item.offset + item.length))
        got = np.frombuffer(item.data["pixel_values"].data, dtype=np.float32).reshape(item.data["pixel_values"].shape)
        np.testing.assert_array_equal(got[0], pixels[k])
        if name != "llava":
            mask = item.data["pixel_attention_mask"]
            assert mask.shape == [1, 32, 32] and item.mm_hash.endswith(f"#{item.part}")
    assert covered == {i for i, t in enumerate(ids) if t == ours.image_token_id}


def test_idefics3_items_count_as_parts_of_their_image(family):
    name, _, ours = family
    if name == "llava":
        pytest.skip("one item per image")
    _, features = _run(ours, f"a {IMAGE_TOKEN} b {IMAGE_TOKEN}", [random_image(0, 48, 40), random_image(1, 64, 20)])
    assert [f.part for f in features] == [0, 1, 2, 3, 4, 0, 1, 2]
    assert len({f.mm_hash.rpartition("#")[0] for f in features}) == 2


def test_a_repeated_image_is_processed_once_and_expands_the_same(family, monkeypatch):
    _, _, ours = family
    image = random_image(7, 48, 40)
    first = _run(ours, f"x {IMAGE_TOKEN} y", [image])
    monkeypatch.setattr(ours.expander, "expand", lambda image: pytest.fail("processed again"))
    again = _run(ours, f"x {IMAGE_TOKEN} y", [image.copy()])
    assert again == first


def test_a_processor_whose_token_count_disagrees_with_the_config_is_refused(tmp_path):
    path = make_tiny_idefics3(str(tmp_path))
    with pytest.raises(ValueError, match="image_seq_len"):
        MultiModalProcessor(_info(path, 64), load_tokenizer(path))
