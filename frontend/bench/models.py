"""Random-weight checkpoints in the shapes the GPU benchmarks run (nothing can be downloaded on the GPU
machines): `pagedserve bench throughput --make-model NAME --model PATH` writes one to PATH if it is missing.

The writer is HF transformers' own (its config classes, random init and save_pretrained); the tokenizer is
synthetic, one word per id, since the benchmarks send token ids. The tests' tiny models take the same one.
`pagedserve bench mm` builds its vision-language models here too (make_vlm): those send text, so they take the
embedded SmolLM2 tokenizer with the image tokens added.
"""
from __future__ import annotations

import os
from typing import Any

QWEN3_06B: dict[str, Any] = dict(
    hidden_size=1024, num_hidden_layers=28, num_attention_heads=16, num_key_value_heads=8, head_dim=128,
    intermediate_size=3072, vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0,
    rms_norm_eps=1e-6, tie_word_embeddings=True, initializer_range=0.02, bos_token_id=1, eos_token_id=2)

# OLMoE-1B-7B's shape (64 experts, top 8, 16 layers; ~6.9B weights, ~1.3B active) as a Qwen3-MoE model, which
# differs from OLMoE only in details that do not change the work (q/k norm per head, not over the whole row).
OLMOE_SHAPE: dict[str, Any] = dict(
    hidden_size=2048, num_hidden_layers=16, num_attention_heads=16, num_key_value_heads=16, head_dim=128,
    num_experts=64, num_experts_per_tok=8, moe_intermediate_size=1024, norm_topk_prob=False,
    intermediate_size=1024, vocab_size=50304, max_position_embeddings=4096, rope_theta=10000.0, rms_norm_eps=1e-5,
    tie_word_embeddings=False, initializer_range=0.02, bos_token_id=1, eos_token_id=2)

MODELS: dict[str, tuple[str, dict[str, Any]]] = {"qwen3-0.6b": ("qwen3", QWEN3_06B),
                                                 "olmoe-shape": ("qwen3_moe", OLMOE_SHAPE)}


def make_model(name: str, path: str) -> bool:
    """Writes model `name` (bf16) to `path` unless that folder exists; True if it wrote one."""
    if os.path.isdir(path):
        return False
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    arch, shape = MODELS[name]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(arch, **shape), dtype=torch.bfloat16)
    model.save_pretrained(path)
    synthetic_tokenizer(shape["vocab_size"]).save_pretrained(path)
    return True


def synthetic_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer with one word "w<i>" per id (bos = w1, eos = w2)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")        # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="w0", bos_token="w1", eos_token="w2")


# Vision-language checkpoints for `pagedserve bench mm`, in shapes a 2-core CPU runs in minutes. The language
# model is SmolLM2-135M's layout (tied embeddings left untied: the same work, and no tying rule to differ on
# between pagedserve's loader and HF's); the vocabulary is the embedded tokenizer's plus the image tokens.
SMOLLM2_135M_TEXT: dict[str, Any] = dict(
    hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
    max_position_embeddings=8192, rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=False,
    initializer_range=0.02)
# CLIP ViT-B/16's tower at 224 px: 196 image tokens per image under the "default" (CLS dropped) strategy.
CLIP_B16_224: dict[str, Any] = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                    num_attention_heads=12, image_size=224, patch_size=16)
# SmolVLM-256M's SigLIP-B/16 tower at 512 px with pixel shuffle 4: 64 tokens per tile. Its processor's size is
# held to one tile (longest edge 512): SmolVLM's own (2048, 4 x 4 tiles + a global one, ~1100 tokens an image)
# would make the vision tower alone minutes per batch on 2 cores.
SIGLIP_B16_512: dict[str, Any] = dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=12,
                                      num_attention_heads=12, image_size=512, patch_size=16)
VLM_MODELS = ("llava-b16-smollm2-135m", "smolvlm-256m-shape")
IDEFICS3 = "Idefics3ForConditionalGeneration"

LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'].upper() }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
SMOLVLM_CHAT_TEMPLATE = (
    "<|im_start|>{% for message in messages %}{{ message['role'] | capitalize }}: "
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<image>{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<end_of_utterance>{{ '\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}")


def default_vlm() -> str:
    """SmolVLM's shape once pagedserve serves Idefics3, else the Llava."""
    from pagedserve.executor.model.models import supported_architectures
    return VLM_MODELS[1] if IDEFICS3 in supported_architectures() else VLM_MODELS[0]


def make_vlm(name: str, path: str) -> bool:
    """Writes VLM `name` (bf16 weights, its processor and chat template) to `path` unless that folder exists;
    True if it wrote one. ValueError for an unknown name."""
    if name not in VLM_MODELS:
        raise ValueError(f"unknown VLM {name!r}; choose from {', '.join(VLM_MODELS)}")
    if os.path.isdir(path):
        return False
    from pagedserve.frontend.bench.tokenizers import load_bench_tokenizer
    tokenizer = load_bench_tokenizer(None)
    model, processor = (_llava if name == VLM_MODELS[0] else _idefics3)(tokenizer)
    tmp = path + ".partial"             # a run stopped half way leaves no folder that looks complete
    model.save_pretrained(tmp)
    processor.save_pretrained(tmp)
    os.replace(tmp, path)
    return True


def _text_config(tokenizer: Any) -> Any:
    from transformers import LlamaConfig
    return LlamaConfig(**SMOLLM2_135M_TEXT, vocab_size=len(tokenizer), bos_token_id=tokenizer.bos_token_id,
                       eos_token_id=tokenizer.eos_token_id)


def _llava(tokenizer: Any) -> tuple[Any, Any]:
    import torch
    from transformers import CLIPVisionConfig, LlavaConfig, LlavaForConditionalGeneration, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    tokenizer.add_special_tokens({"additional_special_tokens": ["<image>"]})
    size, patch = CLIP_B16_224["image_size"], CLIP_B16_224["patch_size"]
    config = LlavaConfig(vision_config=CLIPVisionConfig(**CLIP_B16_224), text_config=_text_config(tokenizer),
                         image_token_index=tokenizer.convert_tokens_to_ids("<image>"), vision_feature_layer=-2,
                         vision_feature_select_strategy="default")
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.bfloat16)
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=patch,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1,
                               chat_template=LLAVA_CHAT_TEMPLATE)
    return model, processor


def _idefics3(tokenizer: Any) -> tuple[Any, Any]:
    import torch
    from transformers import (Idefics3Config, Idefics3ForConditionalGeneration, Idefics3Processor,
                              Idefics3VisionConfig)
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil
    # SmolVLM's vocabulary has the tile tags as single tokens; the processor adds only the three it names.
    tags = ["<global-img>"] + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)]
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>", *tags]})
    tile, scale = SIGLIP_B16_512["image_size"], 4
    config = Idefics3Config(vision_config=Idefics3VisionConfig(**SIGLIP_B16_512), text_config=_text_config(tokenizer),
                            scale_factor=scale, image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    torch.manual_seed(0)
    model = Idefics3ForConditionalGeneration(config).to(torch.bfloat16)
    image_processor = Idefics3ImageProcessorPil(size={"longest_edge": tile}, max_image_size={"longest_edge": tile})
    processor = Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                                  image_seq_len=(tile // SIGLIP_B16_512["patch_size"]) ** 2 // scale ** 2,
                                  chat_template=SMOLVLM_CHAT_TEMPLATE)
    return model, processor


def random_image(seed: int, size: int) -> Any:
    """Uniform random RGB noise, `size` pixels square, as a PIL image (what the issue's requests send)."""
    import numpy as np
    from PIL import Image
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(size, size, 3), dtype=np.uint8))
