"""Random-weight checkpoints in the shapes the GPU benchmarks run (nothing can be downloaded on the GPU
machines): `pagedserve bench throughput --make-model NAME --model PATH` writes one to PATH if it is missing.

The writer is HF transformers' own (its config classes, random init and save_pretrained); the tokenizer is
synthetic, one word per id, since the benchmarks send token ids. The tests' tiny models take the same one.
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
