"""Qwen2-VL's expansion (Qwen2VLProcessor's, without torchvision): transformers' PIL image processor resizes
each image to multiples of patch_size * merge_size within [min_pixels, max_pixels] and flattens it into
patches with its grid [[1, h, w]]; the prompt's single `<|image_pad|>` (between the chat template's
`<|vision_start|>` and `<|vision_end|>`) becomes h * w / merge_size^2 of them, as the processor's
replace_image_token makes it. An image is one item.

A video is one item too: its frames are resized and normalized by the same PIL processor, at the video
processor's pixel bounds (Qwen2VLVideoProcessor's own needs torchvision), padded to whole temporal patches by
repeating the last, and laid out as Qwen2VLVideoProcessor.patchify lays them out: per temporal patch, the
frames' patches in the image's block order, each patch's pixels as (channel, frame, row, column). It takes
t * h * w / merge_size^2 `<|video_pad|>` tokens, grid `video_grid_thw` [[t, h, w]]. A Qwen2.5-VL video also
carries `second_per_grid_ts`, the seconds one temporal patch spans: temporal_patch_size over the kept frames'
rate, 24 frames a second where the source tells none (as Qwen2_5_VLProcessor computes it from transformers'
VideoMetadata.sampled_fps)."""
from __future__ import annotations

from typing import Any

import numpy as np

from pagedserve.common.multimodal.config import load_processor_config
from pagedserve.common.multimodal.families import SECONDS_TENSOR, qwen2_vl_pixels
from pagedserve.frontend.multimodal.expansion_items import Expansion, ItemSpan, tensor_data
from pagedserve.frontend.multimodal.video import SampledVideo
from pagedserve.ipc.messages import EngineInfo

IMAGE_TOKEN, VIDEO_TOKEN = "<|image_pad|>", "<|video_pad|>"
UNKNOWN_FPS = 24.0          # transformers' VideoMetadata.sampled_fps where a video's rate is unknown


def load_image_processor(info: EngineInfo) -> Any:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    return Qwen2VLImageProcessorPil.from_pretrained(info.model_path, **info.mm_processor_kwargs)


class Qwen2VLExpander:
    def __init__(self, info: EngineInfo, tokenizer: Any) -> None:
        self.image_processor = load_image_processor(info)
        # the tokenizer may name its own placeholders, as Qwen2VLProcessor reads them
        self.image_token = getattr(tokenizer, "image_token", None) or IMAGE_TOKEN
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self.video_token = getattr(tokenizer, "video_token", None) or VIDEO_TOKEN
        self.video_token_id = int(tokenizer.convert_tokens_to_ids(self.video_token))
        self.merge = int(self.image_processor.merge_size)
        self.max_tokens = info.mm_max_tokens_per_item
        # the video processor's pixel bounds: its saved settings, --mm-processor-kwargs over them
        video = {**load_processor_config(info.model_path, "video"), **info.mm_processor_kwargs}
        low, high = qwen2_vl_pixels(video, "video")
        self.video_size = {"shortest_edge": low, "longest_edge": high}
        self.timed = info.mm_family == "qwen2_5_vl"       # its videos carry their seconds per temporal patch

    def expand(self, image: Any) -> Expansion:
        out = self.image_processor(images=[image], return_tensors="np")
        grid = np.asarray(out["image_grid_thw"], dtype=np.int64)
        length = int(grid.prod()) // self.merge ** 2
        if length > self.max_tokens:
            raise ValueError(f"mm_processor_kwargs: an image of {length} tokens, more than the engine's "
                             f"{self.max_tokens} (max_pixels differs between the processor and the engine)")
        data = {"pixel_values": tensor_data(np.asarray(out["pixel_values"], dtype=np.float32)),
                "image_grid_thw": tensor_data(grid)}
        return Expansion([self.image_token_id] * length, [ItemSpan(0, length, data)], whole=True)

    def expand_video(self, video: SampledVideo) -> Expansion:
        """The video's sampled frames [T, H, W, 3] uint8 (and their rate) -> its expansion."""
        from PIL import Image
        frames = video.frames
        out = self.image_processor(images=[Image.fromarray(f) for f in frames], size=self.video_size,
                                   return_tensors="np")
        _, h, w = (int(x) for x in out["image_grid_thw"][0])
        p, tps = int(self.image_processor.patch_size), int(self.image_processor.temporal_patch_size)
        flat = np.asarray(out["pixel_values"], dtype=np.float32)
        channels = flat.shape[1] // (tps * p * p)
        # each frame's own patches: the image processor repeats a frame over the temporal patch
        patches = flat.reshape(len(frames), h * w, channels, tps, p, p)[:, :, :, 0]
        if pad := -len(frames) % tps:
            patches = np.concatenate([patches, np.repeat(patches[-1:], pad, axis=0)])
        t = len(patches) // tps
        pixels = patches.reshape(t, tps, h * w, channels, p, p).transpose(0, 2, 3, 1, 4, 5).reshape(t * h * w, -1)
        length = t * h * w // self.merge ** 2
        if length > self.max_tokens:
            raise ValueError(f"mm_processor_kwargs: a video of {length} tokens, more than the engine's "
                             f"{self.max_tokens} (the processor's pixel bounds differ from the engine's)")
        data = {"pixel_values_videos": tensor_data(np.ascontiguousarray(pixels)),
                "video_grid_thw": tensor_data(np.array([[t, h, w]], dtype=np.int64))}
        if self.timed:
            data[SECONDS_TENSOR] = tensor_data(np.array([tps / (video.fps or UNKNOWN_FPS)], dtype=np.float32))
        return Expansion([self.video_token_id] * length, [ItemSpan(0, length, data)], whole=True)
