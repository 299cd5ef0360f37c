"""A tiny random-weight Gemma 3 (SigLIP tower + Gemma 3 text model with sliding and global layers) saved as HF
writes it, with its Gemma3Processor (PIL image processor) and a Gemma-style chat template."""
from __future__ import annotations

import os

import torch

from pagedserve.tests.helpers.models.tiny_models import embedded_tokenizer

IMAGE = "<start_of_image>"          # the placeholder a prompt holds per image (HF's boi_token)
SPECIAL = {"boi_token": IMAGE, "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"}
TOKENS_PER_IMAGE = 16
# Gemma 3's template, cut down: turns as <start_of_turn>role, an image part as the placeholder
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<start_of_turn>"
    "{{ 'model' if message['role'] == 'assistant' else message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% else %}"
    "{% for item in message['content'] %}{% if item['type'] == 'image' %}<start_of_image>"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}{% endif %}"
    "<end_of_turn>\n{% endfor %}{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")


def gemma3_tokenizer():
    """The embedded SmolLM2 tokenizer with Gemma 3's image tokens, named as Gemma3Processor reads them."""
    tok = embedded_tokenizer()
    tok.add_special_tokens({"extra_special_tokens": list(SPECIAL.values())})
    tok._set_model_specific_special_tokens(SPECIAL)     # tokenizer.boi_token, .image_token_id, ...
    return tok


def make_tiny_gemma3(path: str, seed: int = 0, sliding_window: int = 8, tie: bool = False) -> str:
    """Write a random Gemma3ForConditionalGeneration (32x32 images in 4x4 patches, pooled 2x2 to 16 tokens; a
    text model of two sliding layers and one global) and its Gemma3Processor into path. The window
    (8) is shorter than an image, so a sliding layer's bidirectional rows reach past it, as HF's mask allows.
    tie: the head tied to the embedding, as Gemma 3's checkpoints have it (a tiny random model then mostly
    repeats its last token, so the engine tests take an untied head)."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, Gemma3Processor, Gemma3TextConfig
    from transformers import SiglipVisionConfig
    from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
    tok = gemma3_tokenizer()
    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                image_size=32, patch_size=4, vision_use_head=False)
    text = Gemma3TextConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                            head_dim=16, intermediate_size=128, vocab_size=len(tok), sliding_window=sliding_window,
                            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
                            max_position_embeddings=1024, initializer_range=0.2, query_pre_attn_scalar=16,
                            bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, tie_word_embeddings=tie)
    config = Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=TOKENS_PER_IMAGE,
                          boi_token_index=tok.boi_token_id, eoi_token_index=tok.eoi_token_id,
                          image_token_index=tok.image_token_id, initializer_range=0.2, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = Gemma3ForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():       # HF zeroes the projection and the (1 + w) norms at init: random ones make
        for name, param in model.named_parameters():      # images matter and greedy tokens vary
            if "mm_input_projection" in name or (name.endswith("norm.weight") and "vision_tower" not in name):
                param.normal_(0, 0.2)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    image_processor = Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    Gemma3Processor(image_processor=image_processor, tokenizer=tok, image_seq_length=TOKENS_PER_IMAGE,
                    chat_template=CHAT_TEMPLATE).save_pretrained(path)
    return path
