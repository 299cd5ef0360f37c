"""Tiny random-weight models saved as HF safetensors folders (loaded through the real loader)."""
from __future__ import annotations

import os
from typing import Any

import torch

_DEFAULTS: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=512, max_position_embeddings=1024,
                                 initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2)


def make_tiny_model(path: str, arch: str = "llama", sharded: bool = False, seed: int = 0, **overrides: Any) -> str:
    """Write config.json + safetensors for a random model of `arch` (llama, mistral, qwen2, qwen3)."""
    import transformers
    from transformers import AutoModelForCausalLM
    config_cls = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
                  "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config}[arch]
    fields = {**_DEFAULTS, **overrides}
    if arch == "qwen3":
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    config = config_cls(**fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, max_shard_size="100KB" if sharded else "10GB")
    if sharded and not os.path.isfile(os.path.join(path, "model.safetensors.index.json")):
        raise RuntimeError("expected a sharded checkpoint")
    # Any tokenizer covering the tiny vocabulary will do: reuse the embedded model's.
    from pagedserve.core.model_files import resolve_model
    from pagedserve.frontend.tokenizer import load_tokenizer
    load_tokenizer(resolve_model(None)).save_pretrained(path)
    return path
