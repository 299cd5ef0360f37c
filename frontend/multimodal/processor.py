"""Images in, placeholder-expanded token ids and one MultiModalFeature per image out (the frontend's side of
vLLM V1's multimodal split).

The HF image processor (its PIL backend: torchvision is optional) turns each image into the tensors the
vision tower reads. Its output is cached by the image's content hash, so a repeated image is processed once.
The prompt keeps one placeholder token per image; each is expanded to the item's token count as the HF
processor expands it, and the item's run of placeholders is recorded.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from pagedserve.common.errors import RequestError
from pagedserve.frontend.multimodal.chat_parts import MediaRef
from pagedserve.frontend.multimodal.media import MediaLimits, load_image
from pagedserve.ipc.messages import EngineInfo, MultiModalFeature, TensorData

_FIELD = "multi_modal_data"


def tensor_data(array: np.ndarray) -> TensorData:
    array = np.ascontiguousarray(array)
    return TensorData(dtype=str(array.dtype), shape=list(array.shape), data=array.tobytes())


def image_hash(image: Any, salt: str) -> str:
    """sha256 of the decoded pixels, their size and mode, and the processing settings: the same picture sent
    as PNG or as a URL shares an entry; the same bytes processed differently do not."""
    h = hashlib.sha256(salt.encode())
    h.update(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class _ProcessedCache:
    """Processed items by hash, least recently used out past the byte budget (--mm-processor-cache-gb)."""

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes, self.nbytes = max_bytes, 0
        self.items: OrderedDict[str, dict[str, TensorData]] = OrderedDict()
        self._lock = threading.Lock()       # the processing pool's threads share it

    def get(self, key: str) -> dict[str, TensorData] | None:
        with self._lock:
            data = self.items.get(key)
            if data is not None:
                self.items.move_to_end(key)
            return data

    def put(self, key: str, data: dict[str, TensorData]) -> None:
        size = sum(len(t.data) for t in data.values())
        if size > self.max_bytes:
            return
        with self._lock:
            if key in self.items:
                return
            self.items[key] = data
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                _, old = self.items.popitem(last=False)
                self.nbytes -= sum(len(t.data) for t in old.values())


class MultiModalProcessor:
    def __init__(self, info: EngineInfo, tokenizer: Any, cache_gb: float = 4.0,
                 max_image_bytes: int | None = None) -> None:
        from transformers import AutoProcessor
        self.info = info
        self.media_limits = MediaLimits(allowed_local_media_path=info.allowed_local_media_path,
                                        max_image_bytes=max_image_bytes)
        self.hf = AutoProcessor.from_pretrained(info.model_path, **info.mm_processor_kwargs)
        self.image_processor = self.hf.image_processor
        self.image_token = self.hf.image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self._salt = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        self.cache = _ProcessedCache(int(cache_gb * 2**30))

    @property
    def max_images(self) -> int:
        return self.info.mm_limits.get("image", 0)

    def check_count(self, num_images: int, field: str) -> None:
        if num_images > self.max_images:
            raise RequestError.at(field, f"{num_images} images, more than the {self.max_images} a prompt may "
                                  "hold (--limit-mm-per-prompt)")

    def expand(self, token_ids: list[int], images: list[Any], field: str = _FIELD) -> tuple[list[int], list[MultiModalFeature]]:
        """token_ids with one placeholder per image -> expanded ids and the images' features."""
        self.check_count(len(images), field)
        marks = [i for i, t in enumerate(token_ids) if t == self.image_token_id]
        if len(marks) != len(images):
            raise RequestError.at(field, f"the prompt holds {len(marks)} {self.image_token} placeholder(s) for "
                                  f"{len(images)} image(s): give one per image")
        ids: list[int] = []
        features = []
        prev = 0
        for mark, image in zip(marks, images):
            mm_hash, data, length = self._item(image, field)
            ids.extend(token_ids[prev:mark])
            features.append(MultiModalFeature(modality="image", mm_hash=mm_hash, offset=len(ids), length=length,
                                              data=data))
            ids.extend([self.image_token_id] * length)
            prev = mark + 1
        ids.extend(token_ids[prev:])
        return ids, features

    def _item(self, image: Any, field: str) -> tuple[str, dict[str, TensorData], int]:
        from PIL import Image
        if not isinstance(image, Image.Image):
            raise RequestError.at(field, f"an image must be a PIL.Image.Image, got {type(image).__name__}")
        image = image.convert("RGB") if image.mode != "RGB" else image
        mm_hash = image_hash(image, self._salt)
        data = self.cache.get(mm_hash)
        if data is None:
            out = self.image_processor(images=[image], return_tensors="np")
            data = {name: tensor_data(np.asarray(value)) for name, value in out.items()}
            self.cache.put(mm_hash, data)
        return mm_hash, data, self.info.mm_max_tokens_per_item


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
