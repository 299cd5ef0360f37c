"""The core's check of multimodal items: the per-prompt limit counts images, an Idefics3 image's sub-images
(parts 1, 2, ... after its part 0) included in the one, and a part out of its image's order is refused."""
from __future__ import annotations

import pytest

from pagedserve.common.errors import RequestError
from pagedserve.common.multimodal.config import MultiModalConfig
from pagedserve.common.multimodal.families import ItemRule
from pagedserve.core.multimodal.checks import check_mm_features
from pagedserve.ipc.messages import MultiModalFeature, TensorData

CONFIG = MultiModalConfig(limit_per_prompt={"image": 2}, processor_kwargs={}, processor_cache_gb=0.0,
                          allowed_local_media_path=None, max_tokens_per_item=4,
                          item_rules={"image": ItemRule({"pixel_values": [1]})}, encoder_budget=8,
                          encoder_cache_size=8)


def items(parts: list[int]) -> list[MultiModalFeature]:
    data = {"pixel_values": TensorData("float32", [1], b"\0\0\0\0")}
    return [MultiModalFeature(modality="image", mm_hash=f"h{i}", offset=5 * i, length=4, data=data, part=part)
            for i, part in enumerate(parts)]


def test_sub_images_count_as_their_one_image():
    assert len(check_mm_features(items([0, 1, 2, 3, 4, 0, 1, 2]), 100, CONFIG)) == 8
    with pytest.raises(RequestError, match="at most 2 image"):
        check_mm_features(items([0, 1, 0, 1, 0]), 100, CONFIG)


@pytest.mark.parametrize("parts", [[1], [0, 2], [0, 1, 1], [-1]])
def test_a_part_out_of_its_images_order_is_refused(parts):
    with pytest.raises(RequestError, match=r"part"):
        check_mm_features(items(parts), 100, CONFIG)
