"""A tiny random-weight Llava (CLIP vision tower + Llama) saved as HF writes it, with its processor, and random
images to feed it."""
from __future__ import annotations

import os
from typing import TYPE_CHECKING

import torch

from pagedserve.frontend.bench.models import LLAVA_CHAT_TEMPLATE
from pagedserve.tests.helpers.models.tiny_models import embedded_tokenizer

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

IMAGE_TOKEN = "<image>"
# Role-prefixed turns, an {'type': 'image'} part rendered as the placeholder the processor expands per image:
# the bench's Llava template (one place for it).
CHAT_TEMPLATE = LLAVA_CHAT_TEMPLATE


def make_tiny_llava(path: str, seed: int = 0) -> str:
    """Write config.json + model.safetensors of a random Llava (32x32 images in 8x8 patches: 16 image tokens
    under the "default" strategy) and its LlavaProcessor (tokenizer with `<image>` added) into path."""
    from transformers import CLIPVisionConfig, LlamaConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    tok = embedded_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    vision = CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                              image_size=32, patch_size=8)
    text = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=len(tok), max_position_embeddings=1024,
                       initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = LlavaConfig(vision_config=vision, text_config=text,
                         image_token_index=tok.convert_tokens_to_ids(IMAGE_TOKEN), vision_feature_layer=-2,
                         vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tok, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=CHAT_TEMPLATE)
    processor.save_pretrained(path)
    return path


def random_image(seed: int, w: int, h: int) -> Image.Image:
    """Uniform random RGB noise of w x h pixels."""
    import numpy as np
    from PIL import Image
    pixels = np.random.default_rng(seed).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    return Image.fromarray(pixels)      # uint8 [h, w, 3]: RGB


# The tokens SmolVLM's tokenizer holds for Idefics3's image expansion: the sub-image grid positions up to the
# processor's 6x6, the global image's tag, and the markers around each sub-image.
IDEFICS3_TOKENS = (["<fake_token_around_image>", IMAGE_TOKEN, "<end_of_utterance>", "<global-img>"]
                   + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])


def make_tiny_idefics3(path: str, seed: int = 0, grid_tokens: bool = True) -> str:
    """Write a random Idefics3 (SmolVLM layout: 32x32 sub-images in 4x4 patches, pixel shuffle by 2: 16 image
    tokens per sub-image; a Llama text model) and its Idefics3Processor into path. Images are resized to a
    longest edge of 64, so most split into 2x2 sub-images plus the global one. grid_tokens=False leaves
    `<row_i_col_j>` and `<global-img>` as plain text, as a tokenizer without them spells them."""
    from transformers import Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor, Idefics3VisionConfig
    from transformers import LlamaConfig
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    tok = embedded_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": IDEFICS3_TOKENS if grid_tokens else IDEFICS3_TOKENS[:3]})
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tok, image_seq_len=16,
                                  chat_template=CHAT_TEMPLATE)
    vision = Idefics3VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=32, patch_size=4)
    text = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                       intermediate_size=128, vocab_size=len(tok), max_position_embeddings=1024,
                       initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                       bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tok.convert_tokens_to_ids(IMAGE_TOKEN))
    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config).to(torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return path


def random_frames(seed: int, n: int, w: int = 32, h: int = 24) -> np.ndarray:
    """n random RGB frames [n, h, w, 3] uint8."""
    import numpy as np
    return np.random.default_rng(seed).integers(0, 256, size=(n, h, w, 3), dtype=np.uint8)


def mp4_bytes(video: np.ndarray, rate: int = 4) -> bytes:
    """frames [T, H, W, 3] uint8 written as an MPEG-4 file at `rate` frames a second (PyAV)."""
    import io

    import av
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as out:
        stream = out.add_stream("mpeg4", rate=rate)
        stream.width, stream.height, stream.pix_fmt = video.shape[2], video.shape[1], "yuv420p"
        for frame in video:
            out.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        out.mux(stream.encode())
    return buf.getvalue()
