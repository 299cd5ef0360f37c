"""Qwen2-VL's frontend expansion against HF's Qwen2VLProcessor logic (built from the PIL image processor): the
expanded prompt ids, pixel_values and image_grid_thw equal HF's for images of several sizes, --mm-processor-kwargs'
max_pixels is honoured and salts the content hash, and a video is laid out as Qwen2VLVideoProcessor lays one
out (its frames padded to whole temporal patches), sampled to num_frames."""
from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from pagedserve.frontend.client.tokenizer import load_tokenizer
from pagedserve.frontend.multimodal.processor import MultiModalProcessor
from pagedserve.frontend.multimodal.video import SampledVideo
from pagedserve.ipc.messages import EngineInfo, TensorData
from pagedserve.tests.helpers.models.tiny_qwen2_vl import IMAGE, VIDEO, hf_processor, make_tiny_qwen2_vl
from pagedserve.tests.helpers.models.tiny_vlm import random_image

SIZES = [(40, 30), (24, 56), (9, 200), (300, 300), (17, 17)]


def _info(path: str, **kwargs: Any) -> EngineInfo:
    return EngineInfo(served_model_name="tiny", model_path=path, tokenizer=path, max_model_len=4096, vocab_size=0,
                      eos_token_ids=[], max_waiting_requests=None, block_size=16, num_blocks=1,
                      mm_limits={"image": 8, "video": 2}, mm_max_tokens_per_item=84, mm_family="qwen2_vl",
                      **kwargs)


def _array(t: TensorData) -> np.ndarray:
    return np.frombuffer(t.data, dtype=t.dtype).reshape(t.shape)


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> str:
    return make_tiny_qwen2_vl(str(tmp_path_factory.mktemp("qwen_expansion")))


@pytest.fixture(scope="module")
def ours(qwen_dir) -> MultiModalProcessor:
    return MultiModalProcessor(_info(qwen_dir), load_tokenizer(qwen_dir))


@pytest.mark.parametrize("text,sizes", [
    (f"<|im_start|>user\n{IMAGE}describe it<|im_end|>\n", SIZES[:1]),
    (f"compare {IMAGE} and {IMAGE} please", SIZES[1:3]),
    (f"{IMAGE}{IMAGE} back to back, then text", SIZES[3:]),
])
def test_expanded_ids_and_tensors_equal_hfs(qwen_dir, ours, text, sizes):
    images = [random_image(i, w, h) for i, (w, h) in enumerate(sizes)]
    want = hf_processor(qwen_dir)(text=text, images=images, return_tensors="np")
    ids, features = ours.expand(load_tokenizer(qwen_dir).encode(text), images)
    assert ids == want["input_ids"][0].tolist()
    assert len(features) == len(images)
    grids = np.concatenate([_array(f.data["image_grid_thw"]) for f in features])
    np.testing.assert_array_equal(grids, want["image_grid_thw"])
    np.testing.assert_array_equal(np.concatenate([_array(f.data["pixel_values"]) for f in features]),
                                  want["pixel_values"])
    for f, grid in zip(features, grids):
        assert f.length == int(grid.prod()) // 4
        assert ids[f.offset:f.offset + f.length] == [ours.image_token_id] * f.length


def test_max_pixels_from_the_flag_is_honoured_and_salts_the_hash(qwen_dir, ours):
    image = random_image(3, 300, 300)
    small = MultiModalProcessor(_info(qwen_dir, mm_processor_kwargs={"max_pixels": 16 * 16}),
                                load_tokenizer(qwen_dir))
    want = hf_processor(qwen_dir, max_pixels=16 * 16)(text=IMAGE, images=[image], return_tensors="np")
    ids, [feature] = small.expand(load_tokenizer(qwen_dir).encode(IMAGE), [image])
    assert ids == want["input_ids"][0].tolist() and feature.length == 4
    _, [default] = ours.expand(load_tokenizer(qwen_dir).encode(IMAGE), [image])
    assert default.length == 36 and default.mm_hash != feature.mm_hash


def test_a_video_is_laid_out_as_the_video_processor_lays_it_out(qwen_dir, ours):
    frame = np.asarray(random_image(5, 40, 24))
    tok = load_tokenizer(qwen_dir)
    ids, [video] = ours.expand(tok.encode(f"a {VIDEO} b"), [], videos=[SampledVideo(np.stack([frame, frame]), None)])
    assert video.modality == "video" and _array(video.data["video_grid_thw"]).tolist() == [[1, 6, 10]]
    assert "second_per_grid_ts" not in video.data        # Qwen2-VL's temporal positions step by 1
    assert ids.count(ours.expander.video_token_id) == video.length == 15
    # two equal frames: one temporal patch, the image's own patches at the video processor's size
    image = hf_processor(qwen_dir, size={"shortest_edge": 256, "longest_edge": 1024})(
        text=IMAGE, images=[random_image(5, 40, 24)], return_tensors="np")
    np.testing.assert_array_equal(_array(video.data["pixel_values_videos"]), image["pixel_values"])
    # three frames: padded with the last to two temporal patches, each patch (channel, frame, row, column)
    other = np.asarray(random_image(6, 40, 24))
    _, [three] = ours.expand(tok.encode(VIDEO), [], videos=[SampledVideo(np.stack([frame, other, other]), None)])
    pixels = _array(three.data["pixel_values_videos"]).reshape(2, 60, 3, 2, 4, 4)
    assert _array(three.data["video_grid_thw"]).tolist() == [[2, 6, 10]] and three.length == 30
    np.testing.assert_array_equal(pixels[0, :, :, 0], image["pixel_values"].reshape(60, 3, 2, 4, 4)[:, :, 0])
    np.testing.assert_array_equal(pixels[1, :, :, 0], pixels[1, :, :, 1])
    np.testing.assert_array_equal(pixels[0, :, :, 1], pixels[1, :, :, 0])


def test_videos_are_sampled_uniformly_to_num_frames(qwen_dir):
    from pagedserve.frontend.multimodal.video import sample_indices, video_frames
    assert sample_indices(10, 4).tolist() == [0, 3, 6, 9]
    assert sample_indices(3, 8).tolist() == [0, 1, 2] and sample_indices(5, -1).tolist() == list(range(5))
    frames = np.arange(10, dtype=np.uint8)[:, None, None, None] * np.ones((1, 8, 8, 3), dtype=np.uint8)
    assert video_frames(frames, 4, "v").frames[:, 0, 0, 0].tolist() == [0, 3, 6, 9]
    four = MultiModalProcessor(_info(qwen_dir, mm_media_io_kwargs={"video": {"num_frames": 4}}),
                               load_tokenizer(qwen_dir))
    assert four.num_frames == 4
