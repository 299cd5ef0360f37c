"""Tiny random-weight models saved as HF safetensors folders, helpers to run our model directly, and
random prompts with HF transformers' greedy continuation of them (the oracle)."""
from __future__ import annotations

import json
import os
import random
from typing import Any

import torch

from pagedserve.frontend.bench.models import synthetic_tokenizer  # noqa: F401  (the tests import it from here too)
from pagedserve.kernels.attention.metadata import AttentionMetadata

# initializer_range 0.2 (HF default 0.02): peaky logits, so greedy argmax has no near-ties.
_DEFAULTS: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 intermediate_size=128, vocab_size=512, max_position_embeddings=1024,
                                 initializer_range=0.2, rms_norm_eps=1e-5, tie_word_embeddings=False,
                                 bos_token_id=1, eos_token_id=2)


def _config_class(arch: str) -> Any:
    import transformers
    classes = {"llama": transformers.LlamaConfig, "mistral": transformers.MistralConfig,
               "qwen2": transformers.Qwen2Config, "qwen3": transformers.Qwen3Config,
               "phi3": transformers.Phi3Config, "gemma2": transformers.Gemma2Config,
               "gemma3": transformers.Gemma3TextConfig, "mixtral": transformers.MixtralConfig,
               "qwen2_moe": transformers.Qwen2MoeConfig, "qwen3_moe": transformers.Qwen3MoeConfig}
    if arch not in classes:
        raise ValueError(f"arch must be one of {sorted(classes)}, got {arch!r}")
    return classes[arch]


def make_tiny_model(path: str, arch: str = "llama", sharded: bool = False, seed: int = 0,
                    tokenizer: str = "embedded", dtype: torch.dtype = torch.float32, **overrides: Any) -> str:
    """Write config.json + safetensors (2 shards + index when `sharded`) for a random `arch` model.

    tokenizer: "embedded" (SmolLM2's) or "synthetic" (one word per id; for machines without the
    embedded model, and for vocabularies larger than SmolLM2's)."""
    from transformers import AutoModelForCausalLM
    fields = {**_DEFAULTS, **overrides}
    if arch in ("qwen3", "qwen3_moe"):
        fields.setdefault("head_dim", fields["hidden_size"] // fields["num_attention_heads"])
    config = _config_class(arch)(**fields)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path)
    if sharded:
        _split_in_two(path)
    if tokenizer == "synthetic":
        synthetic_tokenizer(fields["vocab_size"]).save_pretrained(path)
        return path
    # Any tokenizer covering the tiny vocabulary will do: reuse the embedded model's.
    embedded_tokenizer().save_pretrained(path)
    return path


def make_tiny_serving_model(path: str) -> str:
    """Random Llama weights with the embedded tokenizer's full vocabulary (49152 ids), so text prompts and
    chat work: the serving machinery under many more requests than a real model allows on a small CPU."""
    return make_tiny_model(path, arch="llama", vocab_size=49152, max_position_embeddings=512)


def embedded_tokenizer() -> Any:
    """The embedded SmolLM2's tokenizer (converted from its GGUF once, then read from a cache)."""
    from pagedserve.common.model.model_files import resolve_model, tokenizer_folder
    from pagedserve.frontend.client.tokenizer import load_tokenizer
    return load_tokenizer(tokenizer_folder(resolve_model(None)))


def _split_in_two(path: str) -> None:
    """Rewrite model.safetensors as two shards plus model.safetensors.index.json (HF layout)."""
    from safetensors.torch import load_file, save_file
    single = os.path.join(path, "model.safetensors")
    tensors = load_file(single)
    names = list(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2:]]
    weight_map = {}
    for i, part in enumerate(halves, start=1):
        shard = f"model-{i:05d}-of-00002.safetensors"
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in part})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    os.remove(single)


def dense_prefill_metadata(num_tokens: int, block_size: int, num_blocks: int) -> AttentionMetadata:
    """Metadata for ONE sequence prefilled from position 0: block table [0..num_blocks), slot i = token i."""
    if num_tokens > block_size * num_blocks:
        raise ValueError(f"num_tokens ({num_tokens}) exceeds the cache ({num_blocks} blocks of {block_size})")
    return AttentionMetadata(
        slot_mapping=torch.arange(num_tokens, dtype=torch.int64),
        query_start_loc=torch.tensor([0, num_tokens], dtype=torch.int32),
        seq_lens=torch.tensor([num_tokens], dtype=torch.int32),
        block_tables=torch.arange(num_blocks, dtype=torch.int32)[None, :],
        num_decodes=0, max_query_len=num_tokens, max_seq_len=num_tokens,
        query_start_loc_cpu=[0, num_tokens], seq_lens_cpu=[num_tokens])


def bind_kv_cache(model: torch.nn.Module, num_blocks: int, block_size: int,
                  dtype: torch.dtype = torch.float32) -> None:
    """Give every attention layer its own zeroed cache [2, num_blocks, kv_heads, block_size, head_dim]."""
    for layer in model.attention_layers():
        layer.kv_cache = torch.zeros(2, num_blocks, layer.num_kv_heads, block_size, layer.head_dim, dtype=dtype)


@torch.inference_mode()
def prefill_logits(model: torch.nn.Module, token_ids: list[int], block_size: int = 16) -> torch.Tensor:
    """Float32 logits [len(token_ids), vocab] from one dense prefill through our model."""
    num_blocks = -(-len(token_ids) // block_size)
    bind_kv_cache(model, num_blocks, block_size, next(model.parameters()).dtype)   # fresh: tests stay independent
    meta = dense_prefill_metadata(len(token_ids), block_size, num_blocks)
    ids = torch.tensor(token_ids, dtype=torch.long)
    hidden = model(ids, torch.arange(len(token_ids)), meta)
    return model.compute_logits(hidden)


def random_prompts(seed: int, lengths: list[int], vocab: int, low: int = 100) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, vocab) for _ in range(n)] for n in lengths]


@torch.inference_mode()
def hf_greedy(model, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """HF transformers greedy continuation, one prompt at a time (no padding effects)."""
    outs = []
    for ids in prompts:
        seq = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens, do_sample=False,
                             attention_mask=torch.ones(1, len(ids), dtype=torch.long), pad_token_id=0)
        outs.append(seq[0, len(ids):].tolist())
    return outs


def make_tiny_eagle_head(path: str, target_dir: str, method: str = "eagle", seed: int = 1,
                         draft_vocab_size: int | None = None, with_embedding: bool = False) -> str:
    """A random EAGLE head for the tiny model at target_dir, saved as its published checkpoints are: an
    EAGLE-1 head (`fc`, `layers.0.*` without the input norm; config architectures LlamaForCausalLM) or an
    EAGLE-3 one (`fc`, `midlayer.*`, `norm`, `lm_head` over `draft_vocab_size` ids, `d2t`, `t2d`; config
    architectures LlamaForCausalLMEagle3)."""
    from safetensors.torch import save_file
    from transformers import LlamaConfig
    target = json.load(open(os.path.join(target_dir, "config.json")))
    h, vocab = target["hidden_size"], target["vocab_size"]
    heads, kv_heads = target["num_attention_heads"], target.get("num_key_value_heads") or target["num_attention_heads"]
    hd, inter = h // heads, target["intermediate_size"]
    fields = dict(hidden_size=h, num_hidden_layers=1, num_attention_heads=heads, num_key_value_heads=kv_heads,
                  intermediate_size=inter, vocab_size=vocab, max_position_embeddings=target["max_position_embeddings"],
                  rms_norm_eps=target["rms_norm_eps"], tie_word_embeddings=False)
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int, scale: float = 0.2) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * scale

    def norm() -> torch.Tensor:
        return 1.0 + rand(h, scale=0.1)
    attn_in = 2 * h if method == "eagle3" else h
    layer = {"self_attn.q_proj.weight": rand(heads * hd, attn_in), "self_attn.k_proj.weight": rand(kv_heads * hd, attn_in),
             "self_attn.v_proj.weight": rand(kv_heads * hd, attn_in), "self_attn.o_proj.weight": rand(h, heads * hd),
             "post_attention_layernorm.weight": norm(), "mlp.gate_proj.weight": rand(inter, h),
             "mlp.up_proj.weight": rand(inter, h), "mlp.down_proj.weight": rand(h, inter)}
    if method == "eagle":
        config = LlamaConfig(**fields, architectures=["LlamaForCausalLM"])
        tensors = {"fc.weight": rand(h, 2 * h), **{f"layers.0.{k}": v for k, v in layer.items()}}
    else:
        draft_vocab = draft_vocab_size or vocab
        config = LlamaConfig(**fields, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
        # The draft vocabulary: a random subset of the model's ids, in order; d2t[i] = its id - i.
        keep = torch.sort(torch.randperm(vocab, generator=gen)[:draft_vocab]).values
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[keep] = True
        tensors = {"fc.weight": rand(h, 3 * h), "norm.weight": norm(), "lm_head.weight": rand(draft_vocab, h),
                   "d2t": keep - torch.arange(draft_vocab), "t2d": t2d,
                   "midlayer.input_layernorm.weight": norm(), "midlayer.hidden_norm.weight": norm(),
                   **{f"midlayer.{k}": v for k, v in layer.items()}}
    if with_embedding:
        tensors["embed_tokens.weight"] = rand(vocab, h, scale=1.0)
    os.makedirs(path, exist_ok=True)
    config.save_pretrained(path)
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(path, "model.safetensors"))
    return path
