"""Images and videos in, placeholder-expanded token ids and their MultiModalFeatures out (the frontend's side
of vLLM V1's multimodal split).

The HF image processor (its PIL backend: torchvision is optional) turns each image into the tensors the
vision tower reads, and the family's expansion (expansion.py, qwen2_vl.py) into the token ids that replace the
image's one placeholder and the items among them: one per image for Llava and Qwen2-VL, one per sub-image for
Idefics3. A video (Qwen2-VL: its sampled frames, video.py) is one item, at its own placeholder. The expansion
is cached by the content hash, so a repeated image or video is processed once.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from pagedserve.common.errors import RequestError
from pagedserve.common.multimodal.families import DEFAULT_NUM_FRAMES
from pagedserve.frontend.multimodal.chat_parts import MediaRef
from pagedserve.frontend.multimodal.expansion import expander_for, item_runs
from pagedserve.frontend.multimodal.expansion_items import Expansion
from pagedserve.frontend.multimodal.media import MediaLimits, load_image
from pagedserve.frontend.multimodal.video import SampledVideo, is_video_with_metadata, load_video, video_frames
from pagedserve.ipc.messages import EngineInfo, MultiModalFeature

_FIELD = "multi_modal_data"


def video_hash(video: SampledVideo, salt: str) -> str:
    """sha256 of a video's sampled frames [T, H, W, 3], their rate and the processing settings."""
    h = hashlib.sha256(salt.encode())
    h.update(f"video:{list(video.frames.shape)}:{video.fps!r}".encode())
    h.update(np.ascontiguousarray(video.frames).tobytes())
    return h.hexdigest()


def image_hash(image: Any, salt: str) -> str:
    """sha256 of the decoded pixels, their size and mode, and the processing settings: the same picture sent
    as PNG or as a URL shares an entry; the same bytes processed differently do not."""
    h = hashlib.sha256(salt.encode())
    h.update(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class _ProcessedCache:
    """Processed images by hash, least recently used out past the byte budget (--mm-processor-cache-gb)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.nbytes = max_bytes, 0
        self.items: OrderedDict[str, Expansion] = OrderedDict()
        self._lock = threading.Lock()       # the processing pool's threads share it

    def get(self, key: str) -> Expansion | None:
        with self._lock:
            data = self.items.get(key)
            if data is not None:
                self.items.move_to_end(key)
            return data

    def put(self, key: str, data: Expansion) -> None:
        size = data.nbytes
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self.items:
                return
            self.items[key] = data
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, old = self.items.popitem(last=False)
                self.nbytes -= old.nbytes


class MultiModalProcessor:
    def __init__(self, info: EngineInfo, tokenizer: Any, cache_gb: float = 4.0,
                 max_media_bytes: int | None = None) -> None:
        """max_media_bytes: the most bytes one image or video may have, fetched, read or sent inline
        (engine-serve's --max-body-bytes: a URL must not bring in what the body may not)."""
        self.info = info
        self.media_limits = MediaLimits(allowed_local_media_path=info.allowed_local_media_path,
                                        max_image_bytes=max_media_bytes, max_video_bytes=max_media_bytes)
        self.tokenizer = tokenizer
        self.expander = expander_for(info, tokenizer)
        self.image_processor = self.expander.image_processor
        self.image_token = self.expander.image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        # modality -> its placeholder token (a family that takes videos names its own)
        self.tokens = {"image": self.image_token}
        if "video" in info.mm_limits:
            self.tokens["video"] = self.expander.video_token
        self.token_ids = {int(tokenizer.convert_tokens_to_ids(t)): m for m, t in self.tokens.items()}
        self.num_frames = int((info.mm_media_io_kwargs.get("video") or {}).get("num_frames", DEFAULT_NUM_FRAMES))
        # the processing settings (--mm-processor-kwargs included) are part of every content hash
        self._salt = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        self.cache = _ProcessedCache(int(cache_gb * 2**30))

    @property
    def max_images(self) -> int:
        return self.info.mm_limits.get("image", 0)

    def check_count(self, num_items: int, field: str, modality: str = "image") -> None:
        limit = self.info.mm_limits.get(modality, 0)
        if num_items > limit:
            raise RequestError.at(field, f"{num_items} {modality}s, more than the {limit} a prompt may hold "
                                  "(--limit-mm-per-prompt)")

    def expand(self, token_ids: list[int], images: list[Any], field: str = _FIELD,
               videos: list[Any] | None = None, text: str | None = None) -> tuple[list[int], list[MultiModalFeature]]:
        """token_ids with one placeholder per image (and per video: its SampledVideo) -> expanded ids and the
        items' features, in prompt order. text: the prompt's text, where token_ids were tokenized from it (a
        family whose expansion puts text around each image re-tokenizes it)."""
        given = {"image": list(images), "video": list(videos or [])}
        marks = [(i, self.token_ids[t]) for i, t in enumerate(token_ids) if t in self.token_ids]
        for modality, items in given.items():
            self.check_count(len(items), field, modality)
            held = sum(m == modality for _, m in marks)
            if held != len(items):
                raise RequestError.at(field, f"the prompt holds {held} {self.tokens.get(modality)} placeholder(s) "
                                      f"for {len(items)} {modality}(s): give one per {modality}")
        pending = {m: iter(items) for m, items in given.items()}
        processed = [(modality, *self._processed(modality, next(pending[modality]), field)) for _, modality in marks]
        if text is not None and processed and all(e.text is not None for _, _, e in processed):
            done = self._expand_text(token_ids, text, processed)
            if done is not None:
                return done
        ids: list[int] = []
        features = []
        prev = 0
        for (mark, _), (modality, mm_hash, expansion) in zip(marks, processed):
            ids.extend(token_ids[prev:mark])
            start = len(ids)
            features.extend(MultiModalFeature(modality=modality, mm_hash=item.hash(mm_hash, expansion.whole),
                                              offset=start + item.offset, length=item.length, data=item.data,
                                              part=item.part)
                            for item in expansion.items)
            ids.extend(expansion.token_ids)
            prev = mark + 1
        ids.extend(token_ids[prev:])
        return ids, features

    def _expand_text(self, token_ids: list[int], text: str, processed: list[tuple[str, str, Expansion]]
                     ) -> tuple[list[int], list[MultiModalFeature]] | None:
        """Expanded as HF's processor expands (Gemma 3): each placeholder of the text replaced by its image's
        text, the whole tokenized again, so the added text merges with its neighbours ("USER: " + "\n\n" is
        not the tokens of each); the special tokens the tokenizer added around the text (a BOS) are kept.
        Each item is then the next run of its tokens. None where token_ids are not the text's (the caller
        splices each image's own tokens in)."""
        plain = self.tokenizer.encode(text, add_special_tokens=False)
        pieces = text.split(self.image_token)
        if len(pieces) - 1 != len(processed):
            return None
        for k in range(min(4, len(token_ids) - len(plain)) + 1):       # the tokens added before the text
            if token_ids[k:k + len(plain)] == plain:
                break
        else:
            return None
        wide = pieces[0] + "".join(e.text + piece for (_, _, e), piece in zip(processed, pieces[1:]))
        ids = token_ids[:k] + self.tokenizer.encode(wide, add_special_tokens=False) + token_ids[k + len(plain):]
        items = [(modality, mm_hash, e, item) for modality, mm_hash, e in processed for item in e.items]
        runs = item_runs(ids, self.expander.item_token_id)
        if len(runs) != len(items) or any(n != item.length for (_, n), (*_, item) in zip(runs, items)):
            return None             # the text holds image tokens of its own
        return ids, [MultiModalFeature(modality=modality, mm_hash=item.hash(mm_hash, e.whole), offset=start,
                                       length=item.length, data=item.data, part=item.part)
                     for (start, _), (modality, mm_hash, e, item) in zip(runs, items)]

    def _processed(self, modality: str, value: Any, field: str) -> tuple[str, Expansion]:
        if modality == "video":
            mm_hash = video_hash(value, self._salt)
            process = self.expander.expand_video
        else:
            value = _rgb_image(value, field)
            mm_hash = image_hash(value, self._salt)
            process = self.expander.expand
        expansion = self.cache.get(mm_hash)
        if expansion is None:
            expansion = process(value)
            self.cache.put(mm_hash, expansion)
        return mm_hash, expansion


def _rgb_image(image: Any, field: str) -> Any:
    from PIL import Image
    if not isinstance(image, Image.Image):
        raise RequestError.at(field, f"an image must be a PIL.Image.Image, got {type(image).__name__}")
    return image.convert("RGB") if image.mode != "RGB" else image


def load_images(refs: list[MediaRef], limits: MediaLimits, field: str) -> list[Any]:
    """URLs loaded (blocking), PIL images passed through, in order."""
    from PIL import Image
    images = []
    for ref in refs:
        if isinstance(ref, str):
            images.append(load_image(ref, limits, field))
        elif isinstance(ref, Image.Image):
            images.append(ref)
        else:
            raise RequestError.at(field, f"an image part must hold a URL or a PIL image, got {type(ref).__name__}")
    return images


def load_videos(refs: list[MediaRef], limits: MediaLimits, field: str, num_frames: int) -> list[SampledVideo]:
    """Video URLs loaded and decoded (blocking), each its sampled frames, in order."""
    videos = []
    for ref in refs:
        if not isinstance(ref, str):
            raise RequestError.at(field, f"a video part must hold a URL, got {type(ref).__name__}")
        videos.append(load_video(ref, limits, field, num_frames))
    return videos


def offline_videos(value: Any, num_frames: int, field: str) -> list[SampledVideo]:
    """multi_modal_data["video"]: one video (an array [T, H, W, 3], or a list of PIL frames, either alone or
    in a (frames, metadata) pair) or a list of videos -> each its sampled frames."""
    from PIL import Image
    if value is None:
        return []
    one = isinstance(value, np.ndarray) or is_video_with_metadata(value) or (
        isinstance(value, (list, tuple)) and value and all(isinstance(f, Image.Image) for f in value))
    videos = [value] if one else list(value) if isinstance(value, (list, tuple)) else [value]
    return [video_frames(v, num_frames, f"{field}[{i}]") for i, v in enumerate(videos)]
