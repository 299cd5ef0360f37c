"""EAGLE draft heads for Llama-style checkpoints (speculative methods eagle and eagle3).

A head predicts the token after next from the next token's embedding and the model's hidden state at the
current position, so it drafts with a fraction of a layer's cost per token:
- EAGLE-1 (`eagle`): fc(cat[embed(token j+1), final hidden j]) through the head's decoder layer(s), the first
  without its input norm; the model's own LM head reads the sum of the last output and residual. Checkpoints
  such as yuhuili/EAGLE-LLaMA3-Instruct-8B: `fc.weight`, `layers.0.*`, sometimes `embed_tokens.weight`.
- EAGLE-3 (`eagle3`): fc folds the residual stream entering three target layers (an early, a middle, a late one)
  into one hidden state; one layer whose attention reads cat[norm(embedding), norm(hidden)] (2x hidden wide);
  its own norm and an LM head over a smaller draft vocabulary, mapped to the model's ids by `d2t` offsets.
  Checkpoints such as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B: `fc`, `midlayer.*`, `norm`, `lm_head`, `d2t`, `t2d`.
Both take the model's embedding (and EAGLE-1 its LM head) when the checkpoint has none: `share_target`.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.layers.attention import PagedAttention
from pagedserve.executor.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.executor.model.layers.layernorm import RMSNorm
from pagedserve.executor.model.layers.linear import QKVParallelLinear, copy_weight
from pagedserve.executor.model.layers.rotary import get_rope
from pagedserve.executor.model.models.llama import (LlamaAttention, LlamaDecoderLayer, LlamaMLP, _head_dim,
                                                    _num_kv_heads, load_checkpoint_tensor)
from pagedserve.executor.model.models.weight_loading import LoadableModel
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.kernels.attention.metadata import AttentionMetadata


class _EagleHead(LoadableModel):
    """What both heads share: an optional own embedding, weight loading by checkpoint name, sharing with
    the model drafted for."""
    # Checkpoint tensors a head ignores (EAGLE-3's target-to-draft mask: d2t alone maps the ids).
    _IGNORED: tuple[str, ...] = ()

    def __init__(self, hf_config: Any, tp: TPGroup) -> None:
        super().__init__()
        self.config = hf_config
        self.tp = tp
        self.embed_tokens: VocabParallelEmbedding | None = None      # built when the checkpoint has one
        self.rotary_emb = get_rope(hf_config, _head_dim(hf_config))

    def share_target(self, target: nn.Module) -> None:
        if self.embed_tokens is None:
            self.embed_tokens = target.model.embed_tokens

    def stream_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        for name, tensor in weights:
            name = name.removeprefix("model.")
            if name in self._IGNORED or "rotary_emb.inv_freq" in name or self._skip(name):
                continue
            if name == "embed_tokens.weight":
                self._own_embedding(tensor)
                params["embed_tokens.weight"] = self.embed_tokens.weight
            if name in buffers:              # EAGLE-3's d2t
                copy_weight(buffers[name], tensor, name)
            else:
                load_checkpoint_tensor(params, name, tensor, type(self).__name__)
            loaded.add(name)
        return loaded

    def _skip(self, name: str) -> bool:
        return False

    def _own_embedding(self, tensor: torch.Tensor) -> None:
        like = next(self.parameters())
        with torch.device(like.device):
            self.embed_tokens = VocabParallelEmbedding(self.config.vocab_size, self.config.hidden_size, self.tp)
        self.embed_tokens.to(like.dtype)

    def expected_weights(self) -> set[str]:
        """The checkpoint names this head needs; its embedding is optional (the model's is shared)."""
        names: set[str] = set()
        unpacked = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
        for name, _ in self.named_parameters():
            parent, _, leaf = name.rpartition(".")
            module_path, _, proj = parent.rpartition(".")
            for part in unpacked.get(proj, (proj,)):
                names.add(f"{module_path}.{part}.{leaf}" if module_path else f"{part}.{leaf}")
        return {n for n in names if not n.startswith("embed_tokens.")}

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids


class EagleLlamaForCausalLM(_EagleHead):
    def __init__(self, hf_config: Any, tp: TPGroup) -> None:
        super().__init__(hf_config, tp)
        h = hf_config.hidden_size
        bias = bool(getattr(hf_config, "attention_bias", False))
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.layers = nn.ModuleList(LlamaDecoderLayer(hf_config, tp, bias, bias, False)
                                    for _ in range(hf_config.num_hidden_layers))
        self.layers[0].input_layernorm = nn.Identity()     # EAGLE-1 feeds fc's output to attention unnormed
        self.lm_head: ParallelLMHead | None = None         # the model's, from share_target

    def _skip(self, name: str) -> bool:
        # Some checkpoints carry a copy of the model's LM head, or layer 0's (unused) input norm.
        return name.startswith("lm_head.") or name.startswith("layers.0.input_layernorm.")

    def share_target(self, target: nn.Module) -> None:
        super().share_target(target)
        self.lm_head = target.lm_head

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(next tokens' ids, positions, the model's final hidden states there) -> (what the LM head reads,
        the feature for the head's next position): the same tensor for EAGLE-1."""
        h = self.fc(torch.cat([self.embed_tokens(input_ids), features.to(self.fc.weight.dtype)], dim=-1))
        rope = self.rotary_emb.cos_sin(positions, h.dtype)
        residual = None
        for layer in self.layers:
            h, residual = layer(h, residual, rope, meta)
        out = h + residual
        return out, out

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]


class _Eagle3Layer(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        h, bias = cfg.hidden_size, bool(getattr(cfg, "attention_bias", False))
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp, bias, bias, False)
        # Attention reads the embedding and the hidden state side by side.
        self.self_attn.qkv_proj = QKVParallelLinear(2 * h, self.self_attn.head_dim, cfg.num_attention_heads,
                                                    _num_kv_heads(cfg), bias, tp)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, embeds: torch.Tensor, hidden: torch.Tensor, rope: Any,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(x, rope, meta)
        x, residual = self.post_attention_layernorm(x, hidden)
        return self.mlp(x), residual


class Eagle3LlamaForCausalLM(_EagleHead):
    _IGNORED = ("t2d",)

    def __init__(self, hf_config: Any, tp: TPGroup) -> None:
        super().__init__(hf_config, tp)
        h = hf_config.hidden_size
        layers = hf_config.eagle_aux_hidden_state_layer_ids      # set by common/speculative.mark_eagle_head
        self.aux_layers = tuple(layers)
        self.fc = nn.Linear(len(layers) * hf_config.target_hidden_size, h, bias=False)
        self.midlayer = _Eagle3Layer(hf_config, tp)
        self.norm = RMSNorm(h, hf_config.rms_norm_eps)
        draft_vocab = getattr(hf_config, "draft_vocab_size", None) or hf_config.vocab_size
        self.lm_head = ParallelLMHead(draft_vocab, h, tp)
        # draft id -> model id offset (zeros when the draft vocabulary is the model's)
        self.register_buffer("d2t", torch.zeros(draft_vocab, dtype=torch.int64), persistent=False)

    def expected_weights(self) -> set[str]:
        names = super().expected_weights()
        if self.lm_head.vocab_size != self.config.vocab_size:
            names.add("d2t")
        return names

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                features: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """features: the model's residual streams at aux_layers side by side (the step's pass), or the head's
        own previous pre-norm output (its later draft positions)."""
        features = features.to(self.fc.weight.dtype)
        if features.shape[-1] != self.config.hidden_size:
            features = self.fc(features)
        embeds = self.embed_tokens(input_ids)
        rope = self.rotary_emb.cos_sin(positions, embeds.dtype)
        x, residual = self.midlayer(embeds, features, rope, meta)
        return self.norm(x, residual)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (to_target_ids maps an argmax to the model's ids)."""
        return self.lm_head.compute_logits(hidden)

    def to_target_ids(self, ids: torch.Tensor) -> torch.Tensor:
        return ids + self.d2t[ids]

    def attention_layers(self) -> list[PagedAttention]:
        return [self.midlayer.self_attn.attn]
