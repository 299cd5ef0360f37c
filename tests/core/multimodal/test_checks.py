"""The core's check of multimodal items: the per-prompt limit counts images, an Idefics3 image's sub-images
(parts 1, 2, ... after its part 0) included in the one, and a part out of its image's order is refused; a
dynamic item (Qwen2-VL) must agree with its own grid; --media-io-kwargs is checked by name."""
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


def test_a_dynamic_items_grid_sizes_its_tokens_and_patches():
    """Qwen2-VL's items: the grid [[t, h, w]] says how many tokens and patch rows the item must have."""
    import numpy as np

    rule = ItemRule({"pixel_values": [-1, 2], "image_grid_thw": [1, 3]}, "image_grid_thw", 2)
    config = MultiModalConfig(limit_per_prompt={"image": 2}, processor_kwargs={}, processor_cache_gb=0.0,
                              allowed_local_media_path=None, max_tokens_per_item=6, item_rules={"image": rule},
                              encoder_budget=8, encoder_cache_size=8)

    def item(grid: list[int], length: int, rows: int) -> MultiModalFeature:
        data = {"pixel_values": TensorData("float32", [rows, 2], b"\0" * 8 * rows),
                "image_grid_thw": TensorData("int64", [1, 3], np.array([grid], dtype=np.int64).tobytes())}
        return MultiModalFeature(modality="image", mm_hash="h", offset=0, length=length, data=data)

    assert check_mm_features([item([1, 2, 4], 2, 8)], 10, config)
    for bad, match in [(item([1, 2, 4], 3, 8), "takes 2"), (item([1, 2, 4], 2, 7), r"shape \[7, 2\]"),
                       (item([1, 3, 4], 3, 12), "multiples of 2"), (item([2, 4, 4], 8, 32), "more than the 6")]:
        with pytest.raises(RequestError, match=match):
            check_mm_features([bad], 10, config)


def test_media_io_kwargs_are_checked_by_name():
    from pagedserve.common.multimodal.config import processor_settings
    assert processor_settings(None, None, {"video": {"num_frames": 8}}).num_frames == 8
    for bad, match in [({"audio": {}}, "media_io_kwargs.audio"), ({"video": {"fps": 2}}, "fps"),
                       ({"video": {"num_frames": -1}}, "num_frames"), ("x", "JSON object")]:
        with pytest.raises(ValueError, match=match):
            processor_settings(None, None, bad)


def test_a_videos_seconds_per_patch_are_checked_and_bound_its_positions():
    """Qwen2.5-VL's videos: second_per_grid_ts must be a positive, finite float32, and the temporal positions
    it spreads the video over must stay inside the rotary table (position_room past max_model_len)."""
    import numpy as np

    rule = ItemRule({"pixel_values_videos": [-1, 2], "video_grid_thw": [1, 3], "second_per_grid_ts": [1]},
                    "video_grid_thw", 2, "second_per_grid_ts", 2.0)
    config = MultiModalConfig(limit_per_prompt={"video": 1}, processor_kwargs={}, processor_cache_gb=0.0,
                              allowed_local_media_path=None, max_tokens_per_item=64, item_rules={"video": rule},
                              encoder_budget=64, encoder_cache_size=64, position_room=100)

    def video(seconds: float, dtype: str = "float32", t: int = 5) -> MultiModalFeature:
        data = {"pixel_values_videos": TensorData("float32", [t * 4, 2], b"\0" * 8 * t * 4),
                "video_grid_thw": TensorData("int64", [1, 3], np.array([[t, 2, 2]], dtype=np.int64).tobytes()),
                "second_per_grid_ts": TensorData(dtype, [1], np.array([seconds], dtype=dtype).tobytes())}
        return MultiModalFeature(modality="video", mm_hash="v", offset=2, length=t, data=data)

    # 4 temporal steps of 2 * 12.5 positions: the last at 2 + 100, 93 past the prompt's last position (9)
    assert check_mm_features([video(12.5)], 10, config)
    for bad, match in [(video(14.0), "reach 105 past"), (video(float("nan")), "positive and finite"),
                       (video(-1.0), "positive and finite"), (video(float("inf")), "positive and finite"),
                       (video(1.0, "float16"), "float32"), (video(1e30), "rotary table")]:
        with pytest.raises(RequestError, match=match):
            check_mm_features([bad], 10, config)
