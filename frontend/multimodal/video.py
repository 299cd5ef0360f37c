"""Videos in a request: by URL (the image URLs' schemes and limits, media.py), decoded with PyAV, or offline as
a list of frames (PIL images) or an array [T, H, W, 3] of uint8, alone or as vLLM's (frames, metadata) pair.
Either way a video becomes at most `num_frames` RGB frames (--media-io-kwargs '{"video": {"num_frames": N}}'),
sampled uniformly over the video as vLLM's video loader samples them, and the rate of the frames kept
(Qwen2.5-VL spaces a video's temporal positions by it).

Every refusal is a RequestError at the field that named the video.
"""
from __future__ import annotations

import io
import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from pagedserve.common.errors import RequestError
from pagedserve.common.multimodal.families import DEFAULT_NUM_FRAMES
from pagedserve.frontend.multimodal.media import MediaLimits, media_bytes


@dataclass(frozen=True)
class SampledVideo:
    frames: np.ndarray           # [T, H, W, 3] uint8
    fps: float | None            # frames a second of those kept; None where the source's rate is unknown


def sample_indices(total: int, num_frames: int) -> np.ndarray:
    """The frames kept of `total`: num_frames spread evenly from the first to the last (all where
    num_frames is -1 or not below total)."""
    if num_frames == -1 or num_frames >= total:
        return np.arange(total)
    return np.linspace(0, total - 1, num_frames, dtype=int)


def _pixel_limit(limits: MediaLimits) -> int | None:
    from PIL import Image
    return limits.max_image_pixels if limits.max_image_pixels is not None else Image.MAX_IMAGE_PIXELS


def load_video(url: str, limits: MediaLimits, field: str, num_frames: int = DEFAULT_NUM_FRAMES) -> SampledVideo:
    """The sampled frames of the video `url` names, and their rate. Blocks on I/O and decoding."""
    data, source = media_bytes(url, limits, field, "video")
    return decode_video(data, num_frames, limits, field, source)


def decode_video(data: bytes, num_frames: int, limits: MediaLimits, field: str, source: str) -> SampledVideo:
    import av
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise RequestError.at(field, f"{source} holds no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            limit = _pixel_limit(limits)
            if limit is not None and width * height > limit:
                raise RequestError.at(field, f"{source} has frames of {width}x{height} = {width * height} "
                                             f"pixels, over the limit of {limit}")
            frames, total = _decoded_frames(container, stream, num_frames)
            rate = float(stream.average_rate) if stream.average_rate else None
    except RequestError:
        raise
    except Exception as exc:        # PyAV's errors (FFmpegError and its kinds), and whatever broken data raises
        raise RequestError.at(field, f"{source} is not a video PyAV can read: {exc}") from None
    if not frames:
        raise RequestError.at(field, f"{source} holds no frames")
    return SampledVideo(np.stack(frames), _kept_rate(rate, len(frames), total))


def _kept_rate(fps: float | None, kept: int, total: int) -> float | None:
    """The rate of `kept` of `total` frames at `fps` (transformers' VideoMetadata.sampled_fps)."""
    if fps is None or not math.isfinite(fps) or fps <= 0:
        return None
    return kept / total * fps


def _decoded_frames(container: Any, stream: Any, num_frames: int) -> tuple[list[np.ndarray], int]:
    """The sampled frames as RGB arrays, and the frames they were sampled from. Where the container tells its
    frame count, only those are kept as they are decoded; else every frame is decoded, then sampled."""
    total = int(stream.frames or 0)
    if total <= 0:
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(stream)]
        return [frames[i] for i in sample_indices(len(frames), num_frames)], len(frames)
    wanted = sample_indices(total, num_frames).tolist()      # increasing: one frame each at most
    kept: list[np.ndarray] = []
    for index, frame in enumerate(container.decode(stream)):
        if index == wanted[len(kept)]:
            kept.append(frame.to_ndarray(format="rgb24"))
            if len(kept) == len(wanted):
                break
    return kept, total      # fewer kept where the container counted more frames than it holds


def is_video_with_metadata(value: Any) -> bool:
    """vLLM's offline (frames, metadata) pair: metadata a dict of transformers' VideoMetadata fields."""
    return isinstance(value, tuple) and len(value) == 2 and isinstance(value[1], dict)


def video_frames(value: Any, num_frames: int, field: str) -> SampledVideo:
    """An offline video (a list of PIL images, or an array [T, H, W, 3] of uint8, or either with its
    metadata) as sampled frames and their rate."""
    fps = None
    if is_video_with_metadata(value):
        value, fps = value[0], _metadata_rate(value[1], f"{field}[1]")
    frames = _offline_frames(value, field)
    kept = sample_indices(len(frames), num_frames)
    return SampledVideo(np.ascontiguousarray(frames[kept]), None if fps is None else fps * len(kept) / len(frames))


def _metadata_rate(metadata: dict[str, Any], field: str) -> float | None:
    """The rate of the frames given, as transformers' VideoMetadata.sampled_fps reads it: fps, scaled by
    len(frames_indices) / total_num_frames where both are given (the frames are a sample of the source)."""
    fps = metadata.get("fps")
    if fps is None:
        return None
    if isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps) or fps <= 0:
        raise RequestError.at(f"{field}.fps", f"must be a positive number, got {fps!r}")
    indices, total = metadata.get("frames_indices"), metadata.get("total_num_frames")
    if indices is None or total is None:
        return float(fps)
    if not isinstance(indices, (list, tuple, np.ndarray)):
        raise RequestError.at(f"{field}.frames_indices", f"must be a list of frame indices, got {indices!r}")
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise RequestError.at(f"{field}.total_num_frames", f"must be a positive integer, got {total!r}")
    return len(indices) / total * float(fps)


def _offline_frames(value: Any, field: str) -> np.ndarray:
    from PIL import Image
    if isinstance(value, (list, tuple)):
        if not value or not all(isinstance(f, Image.Image) for f in value):
            raise RequestError.at(field, "a video as a list must hold one or more PIL images (its frames)")
        sizes = {f.size for f in value}
        if len(sizes) != 1:
            raise RequestError.at(field, f"a video's frames must share one size, got {sorted(sizes)}")
        frames = np.stack([np.asarray(f.convert("RGB")) for f in value])
    elif isinstance(value, np.ndarray):
        if value.dtype != np.uint8 or value.ndim != 4 or value.shape[-1] != 3 or 0 in value.shape:
            raise RequestError.at(field, f"a video array must be uint8 [T, H, W, 3], got {value.dtype} "
                                         f"{list(value.shape)}")
        frames = value
    else:
        raise RequestError.at(field, f"a video must be a list of PIL images or a numpy array, got "
                                     f"{type(value).__name__}")
    return frames
