"""The Llama family (Llama/SmolLM2, Mistral, Qwen2, Qwen3), tensor-parallel, over paged attention."""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from pagedserve.executor.model.layers.activation import SiluAndMul
from pagedserve.executor.model.layers.attention import PagedAttention
from pagedserve.executor.model.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from pagedserve.executor.model.layers.layernorm import RMSNorm
from pagedserve.executor.model.layers.linear import (MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear,
                                               copy_weight)
from pagedserve.executor.model.layers.rotary import get_rope
from pagedserve.executor.model.models.llama_cpu_step import LlamaCpuDecodeStep
from pagedserve.executor.model.models.weight_loading import LoadableModel
from pagedserve.executor.model.parallel_state import PPGroup, TPGroup
from pagedserve.kernels import ops
from pagedserve.kernels.cpu.decode_step import DecoderWeights, LayerWeights
from pagedserve.kernels.attention.metadata import AttentionMetadata

logger = logging.getLogger(__name__)

Rope = tuple[torch.Tensor, torch.Tensor]     # (cos, sin), each [T, 1, head_dim]

# checkpoint projection -> (our merged projection, shard id)
_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
_UNPACKED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _num_kv_heads(cfg: Any) -> int:
    return getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads


def _head_dim(cfg: Any) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, qkv_bias: bool, o_bias: bool, qk_norm: bool) -> None:
        super().__init__()
        self.head_dim = _head_dim(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          _num_kv_heads(cfg), qkv_bias, tp)
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size, o_bias, tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.q_size, self.kv_size = self.qkv_proj.q_size, self.qkv_proj.kv_size
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim ** -0.5)
        # Qwen3: RMSNorm over each head's q and k before rope.
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps) if qk_norm else None

    def forward(self, h: torch.Tensor, rope: Rope, meta: AttentionMetadata) -> torch.Tensor:
        qkv = self.qkv_proj(h)
        tokens, qk_end = qkv.shape[0], self.q_size + self.kv_size
        # q and k sit side by side in qkv: normalise (Qwen3) and rotate all their heads in one op.
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.q_norm else (None, None, 1e-6)
        qk = ops.qk_norm_rope(qkv[:, :qk_end].view(tokens, -1, self.head_dim), *rope, self.num_heads, *norms)
        qk = qk.view(tokens, qk_end)
        q, k, v = qk[:, :self.q_size], qk[:, self.q_size:], qkv[:, qk_end:]
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup) -> None:
        super().__init__()
        inter, bias = cfg.intermediate_size, bool(getattr(cfg, "mlp_bias", False))
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter, inter], bias, tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias, tp)
        self.act_fn = SiluAndMul()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(h)))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 mlp: nn.Module | None = None) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, tp, qkv_bias, o_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = mlp if mlp is not None else LlamaMLP(cfg, tp)     # MoE families pass their expert block

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, rope: Rope,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (this layer's output, residual stream before it): the next norm adds them."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: Any, tp: TPGroup, qkv_bias: bool, o_bias: bool, qk_norm: bool,
                 make_mlp: Callable[[int], nn.Module | None] | None = None, pp: PPGroup = PPGroup()) -> None:
        """make_mlp(layer index): that layer's MLP, or None for Llama's dense one. pp: the layers of this
        pipeline stage are built (the others are placeholders, so checkpoint names keep their indices), the
        embedding on the first stage, the final norm on the last."""
        super().__init__()
        self.pp = pp
        self.stage = pp.layers(cfg.num_hidden_layers)
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if pp.is_first else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, tp, qkv_bias, o_bias, qk_norm,
                                                      make_mlp(i) if make_mlp else None)
                                    if i in self.stage else nn.Identity() for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps) if pp.is_last else None
        self.rotary_emb = get_rope(cfg, _head_dim(cfg))     # shared by all layers
        # EAGLE-3 drafting: the residual stream entering these layers, side by side, is kept in aux_hidden after
        # each forward (the forward's second output, read by the runner before the next forward).
        self.aux_layers: tuple[int, ...] = ()
        self.aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> Any:
        """Final-normed hidden states; on a stage before the last, (hidden, residual) for the next stage, which
        passes them in as `intermediate`. inputs_embeds [T, hidden] (first stage): the embeddings to start from
        in place of the tokens' own (a multimodal model's, image features merged in)."""
        if intermediate is None:
            h = self.embed_tokens(input_ids) if inputs_embeds is None else inputs_embeds
            residual = None
        else:
            h, residual = intermediate
        rope = self.rotary_emb.cos_sin(positions, h.dtype)
        aux: dict[int, torch.Tensor] = {}
        for i in self.stage:
            if i in self.aux_layers:
                aux[i] = h + residual
            h, residual = self.layers[i](h, residual, rope, meta)
        if aux:        # in the head's order, a layer named twice given twice
            self.aux_hidden = torch.cat([aux[i] for i in self.aux_layers], dim=-1)
        if self.norm is None:
            return h, residual
        return self.norm(h, residual)[0]

    def cpu_step_weights(self) -> DecoderWeights | None:
        """What the C step reads, or None where a layer is outside what it takes."""
        if self.pp.size > 1:
            return None
        layers = []
        eps = self.norm.eps
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if not isinstance(mlp, LlamaMLP) or attn.qkv_proj.tp.size != 1:
                return None
            paged = attn.attn
            if paged.sliding_window is not None or paged.logit_softcap is not None or paged.kv_cache is None:
                return None
            norms = [layer.input_layernorm, layer.post_attention_layernorm] + \
                [n for n in (attn.q_norm, attn.k_norm) if n is not None]
            if any(n.eps != eps for n in norms):
                return None
            linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
            if any(lin.packed is None for lin in linears):
                return None
            layers.append(LayerWeights(
                layer.input_layernorm.weight.data, layer.post_attention_layernorm.weight.data,
                *(lin.packed for lin in linears), paged.kv_cache,
                q_norm=attn.q_norm.weight.data if attn.q_norm else None,
                k_norm=attn.k_norm.weight.data if attn.k_norm else None,
                biases=tuple(None if lin.bias is None else lin.bias.data for lin in linears),
                loras=tuple(None if lin.lora is None else lin.lora.c_pool() for lin in linears)))
        first = self.layers[0].self_attn
        return DecoderWeights(tuple(layers), self.norm.weight.data, first.num_heads, first.num_kv_heads,
                              first.head_dim, eps, first.attn.scale)


class LlamaForCausalLM(LoadableModel):
    """Also the base for Mistral, Qwen2 and Qwen3, which differ only in the flags below."""
    qk_norm = False

    def __init__(self, hf_config: Any, tp: TPGroup, pp: PPGroup = PPGroup()) -> None:
        super().__init__()
        self.config = hf_config
        self.pp = pp
        _warn_sliding_window(hf_config)
        qkv_bias, o_bias = self.attention_biases(hf_config)
        self.model = LlamaModel(hf_config, tp, qkv_bias, o_bias, self.qk_norm,
                                lambda layer: self.make_mlp(hf_config, tp, layer), pp)
        self.lm_head = ParallelLMHead(hf_config.vocab_size, hf_config.hidden_size, tp) if pp.is_last else None
        self.tied = bool(getattr(hf_config, "tie_word_embeddings", False))
        if self.tied and pp.size == 1:
            self.lm_head.tie(self.model.embed_tokens)

    @classmethod
    def attention_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        """(q/k/v bias, o_proj bias): Llama, Mistral and Qwen3 follow `attention_bias` for both."""
        bias = bool(getattr(hf_config, "attention_bias", False))
        return bias, bias

    def make_mlp(self, hf_config: Any, tp: TPGroup, layer: int) -> nn.Module | None:
        """The MLP of decoder layer `layer`; None: the dense LlamaMLP (mixture-of-experts models override)."""
        return None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                intermediate: tuple[torch.Tensor, torch.Tensor] | None = None,
                inputs_embeds: torch.Tensor | None = None) -> Any:
        """input_ids, positions [T] -> final-normed hidden states [T, hidden_size]; before the last pipeline
        stage, (hidden, residual) for the next, which gets them as `intermediate`. inputs_embeds [T, hidden]
        (first stage) replace the embeddings of input_ids."""
        return self.model(input_ids, positions, meta, intermediate, inputs_embeds=inputs_embeds)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """input_ids [T] -> their token embeddings [T, hidden_size] (first pipeline stage only)."""
        if self.model.embed_tokens is None:
            raise ValueError(f"input_ids: pipeline stage {self.pp.rank} holds no token embedding (the first does)")
        return self.model.embed_tokens(input_ids)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [n, hidden_size] -> float32 logits [n, vocab_size], full vocabulary on every rank."""
        return self.lm_head.compute_logits(hidden)

    def make_decode_step(self) -> LlamaCpuDecodeStep | None:
        """A decode step that runs the whole decoder at once (the C step of quantized CPU models), for the model
        runner to build once its KV caches are bound; None where none applies."""
        return LlamaCpuDecodeStep.build(self.model)

    def attention_layers(self) -> list[PagedAttention]:
        return [self.model.layers[i].self_attn.attn for i in self.model.stage]

    def stream_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy HF-named checkpoint tensors into our (merged, sharded) parameters, one by one (load_weights:
        the whole batch checked first). Returns the checkpoint names consumed, comparable with
        `expected_weights()`.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name or (self.tied and name.startswith("lm_head.")):
                continue
            checkpoint_name = name
            if self.pp.size > 1 and (name := self._stage_name(name)) is None:
                continue
            load_checkpoint_tensor(params, name, tensor, type(self).__name__)
            loaded.add(checkpoint_name)
        return loaded

    def _stage_name(self, name: str) -> str | None:
        """A checkpoint name as this pipeline stage loads it, or None for another stage's tensor (a tied
        embedding is the last stage's LM head too)."""
        parts = name.split(".")
        if parts[:2] == ["model", "layers"] and int(parts[2]) not in self.model.stage:
            return None
        if name.startswith("model.embed_tokens."):
            if self.tied and self.pp.is_last:
                return name.replace("model.embed_tokens.", "lm_head.") if not self.pp.is_first else name
            return name if self.pp.is_first else None
        if name.startswith(("model.norm.", "lm_head.")) and not self.pp.is_last:
            return None
        return name

    def expected_weights(self) -> set[str]:
        """Every checkpoint tensor name this model needs (merged parameters expanded to their parts)."""
        names = self._expected_parameters()
        if self.tied and self.pp.size > 1 and self.pp.is_last:      # loaded from the embedding's tensor
            names = {n for n in names if not n.startswith("lm_head.")} | {"model.embed_tokens.weight"}
        return names

    def _expected_parameters(self) -> set[str]:
        names: set[str] = set()
        for name, _ in self.named_parameters():      # a tied lm_head is not listed: shared tensors appear once
            parent, _, leaf = name.rpartition(".")
            module_path, _, proj = parent.rpartition(".")
            for part in _UNPACKED.get(proj, (proj,)):
                names.add(f"{module_path}.{part}.{leaf}" if module_path else f"{part}.{leaf}")
        return names


def load_checkpoint_tensor(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor, owner: str) -> None:
    """Copy one HF-named checkpoint tensor into its (merged, sharded) parameter; ValueError if it has none."""
    target, shard_id = _target_param(name)
    param = params.get(target)
    if param is None:
        raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {owner}")
    loader = getattr(param, "weight_loader", None)
    if loader is None:
        copy_weight(param.data, tensor, name)
        return
    try:
        loader(param, tensor, shard_id)
    except ValueError as exc:       # the layer knows the shapes, the caller the tensor's name
        raise ValueError(f"checkpoint tensor {name!r}: {exc}") from exc


def _target_param(name: str) -> tuple[str, int | str | None]:
    """Checkpoint name -> (our parameter name, shard id for merged parameters)."""
    parts = name.split(".")
    if len(parts) >= 2 and parts[-2] in _PACKED:
        merged, shard_id = _PACKED[parts[-2]]
        return ".".join(parts[:-2] + [merged, parts[-1]]), shard_id
    return name, None


def _warn_sliding_window(cfg: Any) -> None:
    window = getattr(cfg, "sliding_window", None)
    uses_window = getattr(cfg, "use_sliding_window", True)   # Qwen2 keeps a window but switches it off
    if window and uses_window and window < cfg.max_position_embeddings:
        logger.warning("sliding_window=%d is not implemented: attention spans the full context, which "
                       "matches the model only for sequences up to %d tokens", window, window)


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @classmethod
    def attention_biases(cls, hf_config: Any) -> tuple[bool, bool]:
        return True, False


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
