"""The Llama family (Llama/SmolLM2, Mistral, Qwen2, Qwen3), tensor-parallel, over paged attention."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.core.model_files import rope_settings
from pagedserve.executor.layers.activation import SiluAndMul
from pagedserve.executor.layers.attention import PagedAttention
from pagedserve.executor.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.executor.layers.layernorm import RMSNorm
from pagedserve.executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.executor.layers.rotary import RotaryEmbedding
from pagedserve.executor.parallel_state import TPGroup
from pagedserve.kernels.metadata import AttentionMetadata

# checkpoint name -> (our merged parameter, shard id)
_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        heads, kv_heads = cfg.num_attention_heads, getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, heads, kv_heads, bias, tp)
        self.o_proj = RowParallelLinear(heads * self.head_dim, cfg.hidden_size, False, tp)
        self.q_size = self.qkv_proj.num_heads * self.head_dim
        self.kv_size = self.qkv_proj.num_kv_heads * self.head_dim
        theta, scaling = rope_settings(cfg)
        self.rotary = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, theta, scaling)
        self.attn = PagedAttention(self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
                                   self.head_dim ** -0.5)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, positions: torch.Tensor, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        q, k, v = self.qkv_proj(h).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.q_norm is not None:
            q = self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape)
            k = self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)
        q, k = self.rotary(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp)
        self.act = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(h)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp, bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = LlamaMLP(cfg, tp)

    def forward(self, positions: torch.Tensor, h: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(positions, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, bias, qk_norm) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        h, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            h, residual = layer(positions, h, residual, meta)
        return self.norm(h, residual)[0]


class LlamaForCausalLM(nn.Module):
    qkv_bias = False
    qk_norm = False

    def __init__(self, hf_config: Any, tp: TPGroup) -> None:
        super().__init__()
        self.config = hf_config
        bias = self.qkv_bias or bool(getattr(hf_config, "attention_bias", False))
        self.model = LlamaModel(hf_config, tp, bias, self.qk_norm)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tied:
            self.lm_head.tie(self.model.embed_tokens)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Route checkpoint tensors (HF names) into our parameters; returns the parameter names filled."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tied and name.startswith("lm_head.")):
                continue
            target, shard = name, None
            for ckpt, (ours, shard_id) in _PACKED.items():
                if f".{ckpt}." in name:
                    target, shard = name.replace(f".{ckpt}.", f".{ours}."), shard_id
                    break
            param = params.get(target)
            if param is None:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                _copy_whole(param, tensor)
            else:
                loader(param, tensor.to(param.dtype), shard)
            loaded.add(target)
        return loaded

    def expected_parameters(self) -> set[str]:
        names = set(dict(self.named_parameters()))
        return names - ({"lm_head.weight"} if self.tied else set())


def _copy_whole(param: nn.Parameter, tensor: torch.Tensor) -> None:
    if param.shape != tensor.shape:
        raise ValueError(f"weight shape {tuple(tensor.shape)} does not match the parameter's {tuple(param.shape)}")
    param.data.copy_(tensor)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True


class MistralForCausalLM(LlamaForCausalLM):
    pass
