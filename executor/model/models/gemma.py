"""Gemma 2 and Gemma 3 (text), tensor-parallel, over paged attention.

What sets them apart from Llama: GeGLU (gelu-tanh) MLPs, a (1 + weight) RMSNorm computed in float32, a norm
after attention and around the MLP, the embedding scaled by sqrt(hidden) in the model dtype, attention scaled
by query_pre_attn_scalar**-0.5, and layers alternating between a sliding window and global attention.
Gemma 2 soft-caps attention scores and final logits (tanh); Gemma 3 instead normalises each q/k head and
gives its sliding layers their own RoPE base.
"""
from __future__ import annotations

import functools
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.model.layers.attention import PagedAttention
from pagedserve.executor.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.executor.model.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from pagedserve.executor.model.layers.rotary import RotaryEmbedding, get_rope
from pagedserve.executor.model.models.llama import LlamaForCausalLM
from pagedserve.executor.model.models.weight_loading import LoadableModel
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup
from pagedserve.kernels import ops
from pagedserve.kernels.attention.metadata import AttentionMetadata

Rope = tuple[torch.Tensor, torch.Tensor]     # (cos, sin), each [T, 1, head_dim]
SLIDING, FULL = "sliding_attention", "full_attention"


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


@functools.cache
def _in_dtype(value: float, dtype: torch.dtype) -> float:
    """value rounded to dtype, as transformers scales the embedding (sqrt(3072) becomes 55.5 in bf16); a Python
    float, so no tensor is made per step (CUDA graphs) and the product rounds like HF's dtype-by-dtype one."""
    return float(torch.tensor(value, dtype=dtype))


class GemmaRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), all in float32 and cast back once, as transformers' Gemma norms do
    (a Llama-style norm would round to the model dtype before scaling, and 1 + weight in bf16 loses bits)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


def layer_types(cfg: Any) -> list[str]:
    """Each layer's attention kind: `layer_types` (transformers >= 4.53), else the older conventions."""
    types = getattr(cfg, "layer_types", None)
    if types:
        if len(types) != cfg.num_hidden_layers or set(types) - {SLIDING, FULL}:
            raise ValueError(f"layer_types: expected {cfg.num_hidden_layers} of {SLIDING!r}/{FULL!r}, got {types}")
        return list(types)
    pattern = getattr(cfg, "sliding_window_pattern", None)
    if cfg.model_type.startswith("gemma3"):      # every pattern-th layer is global
        pattern = pattern or 6
        return [FULL if (i + 1) % pattern == 0 else SLIDING for i in range(cfg.num_hidden_layers)]
    return [SLIDING if i % 2 == 0 else FULL for i in range(cfg.num_hidden_layers)]   # Gemma 2


class _RopeView:
    """The config as get_rope should see it for one layer kind: that kind's theta and scaling only."""

    def __init__(self, cfg: Any, rope_parameters: dict[str, Any]) -> None:
        self._cfg, self.rope_parameters = cfg, rope_parameters

    def __getattr__(self, name: str) -> Any:
        return getattr(self._cfg, name)


def gemma3_ropes(cfg: Any, head_dim: int) -> dict[str, RotaryEmbedding]:
    """Gemma 3: global layers use rope_theta (and the checkpoint's scaling), sliding layers a plain RoPE at
    rope_local_base_freq. transformers 5 nests both under rope_parameters; 4.x keeps them as flat fields."""
    params = getattr(cfg, "rope_parameters", None)
    if isinstance(params, dict) and FULL in params:
        return {kind: get_rope(_RopeView(cfg, dict(params[kind])), head_dim) for kind in (SLIDING, FULL)}
    local = {"rope_type": "default", "rope_theta": float(getattr(cfg, "rope_local_base_freq", 10000.0))}
    return {SLIDING: get_rope(_RopeView(cfg, local), head_dim), FULL: get_rope(cfg, head_dim)}


class GemmaAttention(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, kind: str, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = _head_dim(cfg)
        kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        bias = bool(getattr(cfg, "attention_bias", False))
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads, kv_heads, bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, bias, tp)
        self.num_heads = self.qkv_proj.num_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        window = cfg.sliding_window if kind == SLIDING else None
        self.attn = PagedAttention(self.num_heads, self.qkv_proj.num_kv_heads, self.head_dim,
                                   float(cfg.query_pre_attn_scalar) ** -0.5, sliding_window=window,
                                   logit_softcap=getattr(cfg, "attn_logit_softcapping", None))
        self.q_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = GemmaRMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, h: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(h)
        tokens, qk_end = qkv.shape[0], self.q_size + self.kv_size
        qk = qkv[:, :qk_end].view(tokens, -1, self.head_dim)
        if self.q_norm is not None:     # Gemma 3: per-head (1 + w) norms, before rope
            qk = torch.cat((self.q_norm(qk[:, :self.num_heads]), self.k_norm(qk[:, self.num_heads:])), dim=1)
        qk = ops.qk_norm_rope(qk, *rope, self.num_heads).reshape(tokens, qk_end)
        q, k, v = qk[:, :self.q_size], qk[:, self.q_size:], qkv[:, qk_end:]
        return self.o_proj(self.attn(q, k, v, meta))


class GemmaMLP(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        act = getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", "gelu_pytorch_tanh")
        if act not in ("gelu_pytorch_tanh", "gelu_tanh"):
            raise ValueError(f"hidden_activation: {act!r} is not supported for Gemma (only 'gelu_pytorch_tanh')")
        inter = cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], False, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, False, tp)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, kind: str, qk_norm: bool) -> None:
        super().__init__()
        self.kind = kind
        eps = cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.self_attn = GemmaAttention(cfg, tp, kind, qk_norm)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)
        self.mlp = GemmaMLP(cfg, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(cfg.hidden_size, eps)

    def forward(self, h: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        h = h + self.post_attention_layernorm(self.self_attn(self.input_layernorm(h), rope, meta))
        return h + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(h)))


class GemmaModel(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, qk_norm: bool, ropes: dict[str, RotaryEmbedding]) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.embed_scale = float(cfg.hidden_size) ** 0.5
        self.layers = nn.ModuleList(GemmaDecoderLayer(cfg, tp, kind, qk_norm) for kind in layer_types(cfg))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.ropes = nn.ModuleDict(ropes)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = self.embed_tokens(input_ids)
        return h * _in_dtype(self.embed_scale, h.dtype)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        # inputs_embeds (a vision-language model's, image rows merged in) are already scaled: HF scales the
        # token embeddings only, never the projected image features
        h = self.embed(input_ids) if inputs_embeds is None else inputs_embeds
        ropes = {kind: rope.cos_sin(positions, h.dtype) for kind, rope in self.ropes.items()}
        for layer in self.layers:
            h = layer(h, ropes[layer.kind], meta)
        return self.norm(h)


class _GemmaForCausalLM(LoadableModel):
    qk_norm = False

    def __init__(self, hf_config: Any, tp: TPGroup) -> None:
        super().__init__()
        self.config = hf_config
        if any(kind == SLIDING for kind in layer_types(hf_config)) and not hf_config.sliding_window:
            raise ValueError("sliding_window: sliding layers need a positive window")
        if getattr(hf_config, "use_bidirectional_attention", False):      # EmbeddingGemma, not a causal LM
            raise ValueError("use_bidirectional_attention: only causal Gemma models are supported")
        self.model = GemmaModel(hf_config, tp, self.qk_norm, self.ropes(hf_config))
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp)
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", True))
        if self.tied:
            self.lm_head.tie(self.model.embed_tokens)
        self.final_softcap = getattr(hf_config, "final_logit_softcapping", None)

    @staticmethod
    def ropes(cfg: Any) -> dict[str, RotaryEmbedding]:
        rope = get_rope(cfg, _head_dim(cfg))
        return {SLIDING: rope, FULL: rope}

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: Any = None, inputs_embeds: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]; inputs_embeds [T, hidden]
        (scaled, as embed_input_ids makes them) replace the embeddings of input_ids. One pipeline stage, so
        there is never an intermediate."""
        return self.model(input_ids, positions, meta, inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The scaled token embeddings [T, hidden] the layers start from."""
        return self.model.embed(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size], soft-capped where the model says so."""
        logits = self.lm_head.compute_logits(hidden)
        if self.final_softcap:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    # Checkpoint names follow the Llama layout (q/k/v and gate/up merged here), so loading is Llama's; Gemma
    # runs in one pipeline stage (common/config_rules.PIPELINE_ARCHITECTURES).
    pp = PPGroup()
    stream_weights = LlamaForCausalLM.stream_weights
    expected_weights = LlamaForCausalLM.expected_weights
    _expected_parameters = LlamaForCausalLM._expected_parameters


class Gemma2ForCausalLM(_GemmaForCausalLM):
    pass


class Gemma3ForCausalLM(_GemmaForCausalLM):
    qk_norm = True

    @staticmethod
    def ropes(cfg: Any) -> dict[str, RotaryEmbedding]:
        return gemma3_ropes(cfg, _head_dim(cfg))
