"""Images in, placeholder-expanded token ids and their MultiModalFeatures out (the frontend's side of vLLM
V1's multimodal split).

The HF image processor (its PIL backend: torchvision is optional) turns each image into the tensors the
vision tower reads, and the family's expansion (expansion.py) into the token ids that replace the image's one
placeholder and the items among them: one per image for Llava, one per sub-image for Idefics3. The expansion
is cached by the image's content hash, so a repeated image is processed once.
"""
from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from typing import Any

from pagedserve.common.errors import RequestError
from pagedserve.frontend.multimodal.chat_parts import MediaRef
from pagedserve.frontend.multimodal.expansion import Expansion, expander_for
from pagedserve.frontend.multimodal.media import MediaLimits, load_image
from pagedserve.ipc.messages import EngineInfo, MultiModalFeature

_FIELD = "multi_modal_data"


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
                 max_image_bytes: int | None = None) -> None:
        from transformers import AutoProcessor
        self.info = info
        self.media_limits = MediaLimits(allowed_local_media_path=info.allowed_local_media_path,
                                        max_image_bytes=max_image_bytes)
        self.hf = AutoProcessor.from_pretrained(info.model_path, **info.mm_processor_kwargs)
        self.image_processor = self.hf.image_processor
        self.image_token = self.hf.image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self.expander = expander_for(self.hf, tokenizer, info)
        self._salt = json.dumps(self.image_processor.to_dict(), sort_keys=True, default=str)
        self.cache = _ProcessedCache(int(cache_gb * 2**30))

    @property
    def max_images(self) -> int:
        return self.info.mm_limits.get("image", 0)

    def check_count(self, num_images: int, field: str) -> None:
        if num_images > self.max_images:
            raise RequestError.at(field, f"{num_images} images, more than the {self.max_images} a prompt may "
                                  "hold (--limit-mm-per-prompt)")

    def expand(self, token_ids: list[int], images: list[Any],
               field: str = _FIELD) -> tuple[list[int], list[MultiModalFeature]]:
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
            mm_hash, expansion = self._processed(image, field)
            ids.extend(token_ids[prev:mark])
            start = len(ids)
            features.extend(MultiModalFeature(modality="image", mm_hash=item.hash(mm_hash, expansion.whole),
                                              offset=start + item.offset, length=item.length, data=item.data,
                                              part=item.part)
                            for item in expansion.items)
            ids.extend(expansion.token_ids)
            prev = mark + 1
        ids.extend(token_ids[prev:])
        return ids, features

    def _processed(self, image: Any, field: str) -> tuple[str, Expansion]:
        from PIL import Image
        if not isinstance(image, Image.Image):
            raise RequestError.at(field, f"an image must be a PIL.Image.Image, got {type(image).__name__}")
        image = image.convert("RGB") if image.mode != "RGB" else image
        mm_hash = image_hash(image, self._salt)
        expansion = self.cache.get(mm_hash)
        if expansion is None:
            expansion = self.expander.expand(image)
            self.cache.put(mm_hash, expansion)
        return mm_hash, expansion


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
