"""Per family, what one image becomes in the prompt: the token ids that replace its single placeholder, and
the items (runs of placeholder tokens, each embedded from one encoder output) within them with their tensors.

- Llava: one item, the image, `mm_max_tokens_per_item` `<image>` tokens.
- Qwen2-VL / Qwen2.5-VL: frontend/multimodal/qwen2_vl.py.
- Idefics3 (SmolVLM): the processor splits the image into rows x cols sub-images plus a global view; each is
  one item of `image_seq_len` `<image>` tokens, framed by `<fake_token_around_image>` and a `<row_i_col_j>` or
  `<global-img>` tag, rows ended by newlines, as Idefics3Processor lays the text out.
- Gemma 3: one item, `mm_tokens_per_image` image tokens between `<start_of_image>` and `<end_of_image>` (one per
  view with pan-and-scan), in HF's replacement text, which is tokenized with the prompt's text.

An Expansion depends only on the image and the processing settings, so the processor caches it by the
image's hash.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np

from pagedserve.common.multimodal.families import QWEN2_VL_FAMILIES
from pagedserve.frontend.multimodal.expansion_items import Expansion, ImageExpander, ItemSpan, tensor_data
from pagedserve.ipc.messages import EngineInfo


class LlavaExpander:
    def __init__(self, hf_processor: Any, tokenizer: Any, info: EngineInfo) -> None:
        self.image_processor = hf_processor.image_processor
        self.image_token = hf_processor.image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(hf_processor.image_token))
        self.length = info.mm_max_tokens_per_item       # every image is resized to the tower's one size

    def expand(self, image: Any) -> Expansion:
        out = self.image_processor(images=[image], return_tensors="np")
        data = {name: tensor_data(np.asarray(value)) for name, value in out.items()}
        return Expansion([self.image_token_id] * self.length, [ItemSpan(0, self.length, data)], whole=True)


class Idefics3Expander:
    def __init__(self, hf_processor: Any, tokenizer: Any, info: EngineInfo) -> None:
        self.image_processor = hf_processor.image_processor
        self.tokenizer = tokenizer
        self.image_token = hf_processor.image_token
        self.image_token_id = int(tokenizer.convert_tokens_to_ids(self.image_token))
        self.fake_token = hf_processor.fake_image_token
        self.global_tag = hf_processor.global_image_tag
        self.seq_len = int(hf_processor.image_seq_len)
        if self.seq_len != info.mm_max_tokens_per_item:
            raise ValueError(f"image_seq_len: the processor gives {self.seq_len} tokens per sub-image, the model's "
                             f"config {info.mm_max_tokens_per_item} (vision image_size / patch_size / scale_factor)")
        self._layout = functools.lru_cache(maxsize=64)(self._layout_ids)

    def expand(self, image: Any) -> Expansion:
        out = self.image_processor(images=[image], return_tensors="np", return_row_col_info=True)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        pixels = np.asarray(out["pixel_values"])[0]                 # [sub-images, channels, H, W]
        masks = np.asarray(out["pixel_attention_mask"])[0]         # [sub-images, H, W]
        ids, offsets = self._layout(rows, cols)
        if len(offsets) != len(pixels):
            raise ValueError(f"pixel_values: {len(pixels)} sub-images for a {rows}x{cols} grid plus the global "
                             f"image ({len(offsets)} runs of {self.image_token})")
        items = [ItemSpan(offset, self.seq_len, {"pixel_values": tensor_data(pixels[k:k + 1]),
                                                 "pixel_attention_mask": tensor_data(masks[k:k + 1])}, part=k)
                 for k, offset in enumerate(offsets)]
        return Expansion(list(ids), items, whole=False)

    def layout_text(self, rows: int, cols: int) -> str:
        """The text an image of rows x cols sub-images (0 x 0: not split) stands for in the prompt."""
        run = self.image_token * self.seq_len
        whole = f"{self.fake_token}{self.global_tag}{run}{self.fake_token}"
        if rows == 0 and cols == 0:
            return whole
        grid = "".join("".join(f"{self.fake_token}<row_{r}_col_{c}>{run}" for c in range(1, cols + 1)) + "\n"
                       for r in range(1, rows + 1))
        return f"{grid}\n{whole}"

    def _layout_ids(self, rows: int, cols: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """The layout's token ids and where each run of `<image>` tokens starts. Tokenized whole: every piece
        of text sits between special tokens, so it splits as it does inside the prompt."""
        ids = self.tokenizer.encode(self.layout_text(rows, cols), add_special_tokens=False)
        offsets = [i for i, t in enumerate(ids) if t == self.image_token_id and (i == 0 or ids[i - 1] != t)]
        runs_ok = all(ids[o:o + self.seq_len] == [self.image_token_id] * self.seq_len for o in offsets)
        if not runs_ok or sum(t == self.image_token_id for t in ids) != self.seq_len * len(offsets):
            raise ValueError(f"tokenizer: {self.image_token} runs of the sub-images are not {self.seq_len} tokens "
                             "each (is it a special token of the tokenizer?)")
        return tuple(ids), tuple(offsets)


class Gemma3Expander:
    """Gemma 3: the prompt's `<start_of_image>` becomes HF's replacement text, "\n\n<start_of_image>",
    `mm_tokens_per_image` image tokens and "<end_of_image>\n\n"; with pan-and-scan (--mm-processor-kwargs
    '{"do_pan_and_scan": true}') an image cropped into k views becomes "Here is the original image ... and here
    are some crops ..." with k + 1 such sequences, each view one item (part j). The text is HF's own
    (Gemma3Processor.replace_image_token) and is tokenized with the prompt's text (Expansion.text)."""

    _CROPS = ("do_pan_and_scan", "pan_and_scan_min_crop_size", "pan_and_scan_max_num_crops",
              "pan_and_scan_min_ratio_to_activate")

    def __init__(self, hf_processor: Any, tokenizer: Any, info: EngineInfo) -> None:
        self.hf_processor = hf_processor
        self.image_processor = hf_processor.image_processor
        self.tokenizer = tokenizer
        self.image_token = hf_processor.boi_token
        self.length = int(hf_processor.image_seq_length)
        if self.length != info.mm_max_tokens_per_item:
            raise ValueError(f"image_seq_length: the processor gives {self.length} tokens per image, the model's "
                             f"config {info.mm_max_tokens_per_item} (mm_tokens_per_image)")
        self.item_token_id = int(tokenizer.convert_tokens_to_ids(tokenizer.image_token))
        # the processor's call defaults (its images_kwargs), the image processor's settings over them
        defaults = dict(getattr(type(hf_processor), "images_kwargs", {}))
        self.crops = {k: getattr(self.image_processor, k, None) if getattr(self.image_processor, k, None) is not None
                      else defaults.get(k) for k in self._CROPS}
        self.crops["do_pan_and_scan"] = bool(self.crops["do_pan_and_scan"])

    def expand(self, image: Any) -> Expansion:
        out = self.image_processor(images=[image], return_tensors="np", **self.crops)
        pixels = np.asarray(out["pixel_values"])           # [1 + crops, channels, H, W]
        num_crops = int(np.asarray(out["num_crops"]).reshape(-1)[0])
        text = self.hf_processor.replace_image_token({"num_crops": [num_crops]}, 0)
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        offsets = item_runs(ids, self.item_token_id)
        if len(offsets) != len(pixels) or any(n != self.length for _, n in offsets):
            raise ValueError(f"processor: {len(pixels)} views of an image, but its text holds runs of "
                             f"{[n for _, n in offsets]} image tokens (want {self.length} each)")
        items = [ItemSpan(o, self.length, {"pixel_values": tensor_data(pixels[k:k + 1])}, part=k)
                 for k, (o, _) in enumerate(offsets)]
        return Expansion(ids, items, whole=num_crops == 0, text=text)


def item_runs(ids: list[int], token_id: int) -> list[tuple[int, int]]:
    """(start, length) of each maximal run of token_id in ids."""
    runs: list[tuple[int, int]] = []
    for i, t in enumerate(ids):
        if t != token_id:
            continue
        if runs and runs[-1][0] + runs[-1][1] == i:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((i, 1))
    return runs


# The HF processor's class -> the expansion of its family
_EXPANDERS: dict[str, type] = {"LlavaProcessor": LlavaExpander, "Idefics3Processor": Idefics3Expander,
                               "Gemma3Processor": Gemma3Expander}


def expander_for(info: EngineInfo, tokenizer: Any) -> ImageExpander:
    """The family's expansion, with its HF processing loaded from the model folder (--mm-processor-kwargs
    over the saved settings)."""
    if info.mm_family in QWEN2_VL_FAMILIES:     # its HF processor needs torchvision: the PIL image processor alone
        from pagedserve.frontend.multimodal.qwen2_vl import Qwen2VLExpander
        return Qwen2VLExpander(info, tokenizer)
    from transformers import AutoProcessor
    hf_processor = AutoProcessor.from_pretrained(info.model_path, **info.mm_processor_kwargs)
    name = type(hf_processor).__name__
    if name not in _EXPANDERS:
        raise ValueError(f"processor: {name} is not supported (supported: {', '.join(_EXPANDERS)})")
    return _EXPANDERS[name](hf_processor, tokenizer, info)
