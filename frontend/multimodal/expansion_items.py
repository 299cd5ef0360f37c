"""What an image's expansion is, whatever its family: the token ids that replace its placeholder and the items
(runs of placeholder tokens, each embedded from one encoder output) within them with their tensors; and what
a family's expander offers (frontend/multimodal/expansion.py and qwen2_vl.py hold them)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from pagedserve.ipc.messages import TensorData


def tensor_data(array: np.ndarray) -> TensorData:
    array = np.ascontiguousarray(array)
    return TensorData(dtype=str(array.dtype), shape=list(array.shape), data=array.tobytes())


@dataclass(frozen=True)
class ItemSpan:
    """One item of an image's expansion: its run of placeholder tokens and what the encoder reads for it."""
    offset: int                         # its first placeholder token, counted from the expansion's start
    length: int
    data: dict[str, TensorData]
    part: int = 0                       # its index among its image's items (MultiModalFeature.part)

    def hash(self, image_hash: str, whole: bool) -> str:
        """The item's content hash: the image's own for a whole image, `#part` after it for a sub-image."""
        return image_hash if whole else f"{image_hash}#{self.part}"


@dataclass(frozen=True)
class Expansion:
    token_ids: list[int]                # what replaces the image's placeholder
    items: list[ItemSpan]               # in order, inside token_ids
    whole: bool                         # one item that is the whole image (its hash is the image's)
    # The text that stands for the image in the prompt's text, for a family whose HF processor expands the
    # text and then tokenizes it (Gemma 3: its "\n\n" merge with the neighbouring text); token_ids are then
    # that text tokenized alone, used where a prompt comes as token ids without its text.
    text: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(t.data) for item in self.items for t in item.data.values())


class ImageExpander(Protocol):
    image_processor: Any        # the HF image processor (its settings salt the content hashes)
    image_token: str            # the placeholder one image part of a prompt holds

    def expand(self, image: Any) -> Expansion:
        """An RGB PIL image -> its expansion (the HF image processor run on it)."""
        ...
