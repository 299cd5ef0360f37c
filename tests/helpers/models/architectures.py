"""The architecture registry of the family-parity suite (tests/executor/model/test_family_parity.py): one tiny random
checkpoint per case, for every architecture the engine supports, with the config quirks each family needs to
show its own code (rope scalings, biases, soft-caps, windows, fused tensors, experts) and the prompts the
checks feed it. A new architecture gets a case here, and the suite runs every check on it."""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from pagedserve.tests.helpers.models.tiny_models import make_tiny_model


@dataclass(frozen=True)
class ArchCase:
    """One tiny checkpoint (make_tiny_model's `arch` and config overrides) and what the checks feed it."""
    arch: str
    fields: dict[str, Any] = field(default_factory=dict)
    # Gemma: HF initialises the norm weights to 0 (scale 1 + 0); random ones make the (1 + w) visible.
    random_norms: bool = False
    # None: the config's max_position_embeddings. Longrope picks its factors by it, so the case sets it.
    max_model_len: int | None = None
    prompt_len: int = 40                    # the logits, model-greedy and TP=2 prompt
    logits_block_size: int = 16             # Gemma: 8, so that the 12-token window spans blocks
    engine_seed: int = 1
    engine_prompts: tuple[int, ...] = (10, 47, 90)
    shared_prefix: tuple[int, tuple[int, ...]] = (40, (5, 17, 30))    # base length, tails
    # Whether the engine check runs: the Llama-layout families (Llama, Mistral, Qwen2, Qwen3) meet the engine
    # as TinyLlama does in test_parity.py (batching, chunked prefill, preemption, prefix hits), so here their
    # cases are checked at the model only; the others bring windows, rope chosen by max_model_len, experts.
    engine: bool = False
    # The TP=2 check's checkpoint, where a config field matters more under TP (a replicated KV head, a
    # vocabulary that does not split evenly); None: the case's own checkpoint.
    tp_fields: dict[str, Any] | None = None


LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               # 64 puts the 16-dim heads' frequencies in all three llama3 bands (kept, smoothed, scaled).
               "original_max_position_embeddings": 64}
PHI3 = dict(sliding_window=None, pad_token_id=0)
PHI3_ORIGINAL = 64
# head_dim 16 -> 8 per-dimension factors, distinct so that short/long or a shift would show.
PHI3_LONGROPE = dict(PHI3, max_position_embeddings=4 * PHI3_ORIGINAL, original_max_position_embeddings=PHI3_ORIGINAL,
                     rope_scaling={"type": "longrope", "short_factor": [1.0, 1.05, 1.1, 1.2, 1.4, 1.7, 2.1, 2.6],
                                   "long_factor": [1.1, 1.5, 2.2, 3.4, 5.1, 7.7, 11.3, 16.9]})
GEMMA_WINDOW = 12
_GEMMA = dict(head_dim=16, query_pre_attn_scalar=24, sliding_window=GEMMA_WINDOW, max_position_embeddings=512,
              pad_token_id=0, num_hidden_layers=4, tie_word_embeddings=True)
GEMMA2 = dict(_GEMMA, attn_logit_softcapping=3.0, final_logit_softcapping=5.0)   # small caps: they bite
GEMMA3 = dict(_GEMMA, sliding_window_pattern=2, rope_theta=50000.0, rope_local_base_freq=500.0)
# Few experts, tiny dims; each family's own routing flags.
MOE = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, intermediate_size=32, sliding_window=None),
    # norm_topk_prob false (Qwen1.5/2-MoE), shared expert with its sigmoid gate, layer 1 dense.
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, mlp_only_layers=[1], norm_topk_prob=False),
    "qwen3_moe": dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True),
}

ARCH_CASES: dict[str, ArchCase] = {
    "llama_gqa": ArchCase("llama"),
    "llama3_rope": ArchCase("llama", dict(rope_scaling=LLAMA3_ROPE, rope_theta=500000.0)),
    "llama_linear_rope": ArchCase("llama", dict(rope_scaling={"rope_type": "linear", "factor": 4.0})),
    "llama_sharded": ArchCase("llama", dict(sharded=True)),
    "llama_mqa_odd_vocab_tied": ArchCase("llama", dict(num_key_value_heads=1, vocab_size=509,
                                                       tie_word_embeddings=True)),
    "mistral": ArchCase("mistral"),
    "qwen2_bias_tied": ArchCase("qwen2", dict(tie_word_embeddings=True)),
    # Qwen2.5's long-context layout; original 32 puts the 16-dim heads' frequencies on both sides of the ramp.
    "qwen2_yarn_rope": ArchCase("qwen2", dict(rope_scaling={"type": "yarn", "factor": 4.0,
                                                            "original_max_position_embeddings": 32},
                                              max_position_embeddings=32)),
    "qwen3": ArchCase("qwen3", dict(head_dim=32)),        # head_dim != hidden / heads
    # Fused qkv_proj and gate_up_proj.
    "phi3": ArchCase("phi3", dict(PHI3, max_position_embeddings=512), engine=True,
                     engine_prompts=(10, 47, 90, 130)),
    # max_model_len 256 > 64: long factors everywhere, which HF uses for every sequence longer than 64.
    "phi3_longrope_long": ArchCase("phi3", PHI3_LONGROPE, prompt_len=70, engine=True, engine_seed=2,
                                   engine_prompts=(65, 90, 150), shared_prefix=(70, (3, 20, 41))),
    # max_model_len 64: short factors, which HF uses while prompt + output stays within 64 tokens.
    "phi3_longrope_short": ArchCase("phi3", PHI3_LONGROPE, max_model_len=PHI3_ORIGINAL, engine=True, engine_seed=3,
                                    engine_prompts=(10, 25, 40), shared_prefix=(33, (1, 4, 7))),
    # Prompts shorter and longer than the window.
    "gemma2": ArchCase("gemma2", GEMMA2, random_norms=True, logits_block_size=8, engine=True,
                       engine_prompts=(5, 11, 47, 90), shared_prefix=(40, (3, 17, 30)),
                       tp_fields=dict(num_key_value_heads=1)),
    "gemma3": ArchCase("gemma3", GEMMA3, random_norms=True, logits_block_size=8, engine=True, engine_seed=2,
                       engine_prompts=(7, 12, 33, 75), shared_prefix=(36, (1, 9, 26)),
                       tp_fields=dict(vocab_size=509)),
    **{arch: ArchCase(arch, dict(fields, pad_token_id=0), engine=True) for arch, fields in MOE.items()},
}

_NORM_SEED = 6


def build(case: ArchCase, path: str, **overrides: Any) -> str:
    """Write the case's checkpoint (config.json, safetensors, a synthetic tokenizer) to `path`."""
    folder = make_tiny_model(str(path), arch=case.arch, tokenizer="synthetic", **{**case.fields, **overrides})
    if case.random_norms:
        _randomize_norms(folder, _NORM_SEED)
    return folder


def _randomize_norms(path: str, seed: int) -> None:
    from safetensors.torch import load_file, save_file
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        if "norm" in name:
            tensors[name] = torch.rand(t.shape, generator=gen) - 0.5
    save_file(tensors, file, metadata={"format": "pt"})
