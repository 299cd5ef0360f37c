"""A tiny random-weight Qwen2-VL saved as transformers writes it (its PIL image processor and a tokenizer with
Qwen's vision tokens and a Qwen-style chat template beside it), and HF's own processor logic over them:
Qwen2VLProcessor built from the PIL image processor (AutoProcessor would need torchvision)."""
from __future__ import annotations

import json
import os
from typing import Any

import torch

from pagedserve.tests.helpers.models.tiny_models import embedded_tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
IMAGE = "<|vision_start|><|image_pad|><|vision_end|>"      # one image part, as the chat template renders it
VIDEO = "<|vision_start|><|video_pad|><|vision_end|>"
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}" + IMAGE + "{% elif part['type'] == 'video' %}" + VIDEO +
    "{% else %}{{ part['text'] }}{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# 4-pixel patches merged 2 x 2: a token per 8 x 8 pixels, images resized to 4 .. 36 tokens (2304 pixels), video
# frames to 4 .. 16
MIN_PIXELS, MAX_PIXELS = 16 * 16, 48 * 48
VIDEO_SIZE = {"shortest_edge": 16 * 16, "longest_edge": 32 * 32}


def make_tiny_qwen2_5_vl(path: str, seed: int = 0) -> str:
    """make_tiny_qwen2_vl's Qwen2.5-VL: window attention over 2 x 2 merged cells, full attention in block 1."""
    return make_tiny_qwen2_vl(path, seed, version="2.5")


def make_tiny_qwen2_vl(path: str, seed: int = 0, tie: bool = False, version: str = "2") -> str:
    """Write config.json + model.safetensors of a random Qwen2-VL (2-layer tower of width 32, 2-layer Qwen2 of
    width 64 with mrope_section [2, 3, 3]), its Qwen2VLImageProcessorPil and tokenizer into path."""
    import transformers
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    tok = embedded_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    tok.chat_template = CHAT_TEMPLATE
    ids = {t: tok.convert_tokens_to_ids(t) for t in VISION_TOKENS}
    text = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                intermediate_size=128, vocab_size=len(tok), max_position_embeddings=1024, initializer_range=0.2,
                rms_norm_eps=1e-5, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]})
    vision = dict(depth=2, num_heads=2, patch_size=4, temporal_patch_size=2, spatial_merge_size=2, in_channels=3,
                  initializer_range=0.2)
    if version == "2":
        vision.update(embed_dim=32, hidden_size=64, mlp_ratio=2)
        config_cls, model_cls = transformers.Qwen2VLConfig, transformers.Qwen2VLForConditionalGeneration
    else:
        vision.update(hidden_size=32, out_hidden_size=64, intermediate_size=48, hidden_act="silu", window_size=16,
                      fullatt_block_indexes=[1], tokens_per_second=2)
        config_cls, model_cls = transformers.Qwen2_5_VLConfig, transformers.Qwen2_5_VLForConditionalGeneration
    config = config_cls(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                        video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                        vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    Qwen2VLImageProcessorPil(patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=MIN_PIXELS,
                             max_pixels=MAX_PIXELS).save_pretrained(path)
    tok.save_pretrained(path)
    # what Qwen2VLVideoProcessor.save_pretrained writes (it needs torchvision to run, not to be read)
    video = {"size": VIDEO_SIZE, "patch_size": 4, "temporal_patch_size": 2, "merge_size": 2,
             "video_processor_type": "Qwen2VLVideoProcessor"}
    with open(os.path.join(path, "video_preprocessor_config.json"), "w", encoding="utf-8") as f:
        json.dump(video, f)
    return path


def hf_processor(path: str, **image_kwargs: Any) -> Any:
    """transformers' Qwen2VLProcessor over the saved PIL image processor and tokenizer: HF's placeholder
    expansion and mm_token_type_ids, the oracle of our frontend's."""
    from transformers import AutoTokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    from transformers.processing_utils import ProcessorMixin

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        """Qwen2VLProcessor without its video processor, which needs torchvision (ProcessorMixin requires every
        __init__ argument to be one): its own __call__, replace_image_token and mm_token_type_ids."""

        def __init__(self, image_processor: Any = None, tokenizer: Any = None, chat_template: Any = None) -> None:
            self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
            self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
            self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
            ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    image_processor = Qwen2VLImageProcessorPil.from_pretrained(path, **image_kwargs)
    tokenizer = AutoTokenizer.from_pretrained(path)
    return ImageOnlyQwen2VLProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=CHAT_TEMPLATE)
