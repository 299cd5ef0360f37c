"""BERT-family encoders (BertModel, XLMRobertaModel and their *ForSequenceClassification cross-encoders), as
pooling models: absolute position embeddings, token type (segment) embeddings, post-LN layers with GELU, and
bidirectional attention with no KV cache (layers/encoder_attention.py). One rank: plain torch layers."""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.executor.model.layers.encoder_attention import EncoderAttention
from pagedserve.executor.model.layers.linear import copy_weight
from pagedserve.executor.model.models.weight_loading import LoadableModel
from pagedserve.executor.model.parallel_state import TPGroup
from pagedserve.kernels.attention.metadata import AttentionMetadata

_ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}
# Checkpoint prefixes of the encoder inside a task model (BertForSequenceClassification: bert.*).
_PREFIXES = ("bert.", "roberta.", "model.")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: Any, position_offset: int) -> None:
        super().__init__()
        self.word_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, cfg.hidden_size)
        self.token_type_embeddings = nn.Embedding(max(cfg.type_vocab_size, 1), cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.position_offset = position_offset

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                token_type_ids: torch.Tensor | None) -> torch.Tensor:
        h = self.word_embeddings(input_ids) + self.position_embeddings(positions + self.position_offset)
        if token_type_ids is None or self.token_type_embeddings.num_embeddings == 1:
            h = h + self.token_type_embeddings.weight[0]
        else:
            h = h + self.token_type_embeddings(token_type_ids)
        return self.LayerNorm(h)


class BertLayer(nn.Module):
    """Post-LN: x = LN(x + attn(x)); x = LN(x + mlp(x)). Attribute names follow HF's, so weights load by name."""

    def __init__(self, cfg: Any) -> None:
        super().__init__()
        hidden, heads = cfg.hidden_size, cfg.num_attention_heads
        self.attention = nn.Module()
        self.attention.self = nn.Module()
        for name in ("query", "key", "value"):
            setattr(self.attention.self, name, nn.Linear(hidden, hidden))
        self.attention.output = nn.Module()
        self.attention.output.dense = nn.Linear(hidden, hidden)
        self.attention.output.LayerNorm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        self.intermediate = nn.Module()
        self.intermediate.dense = nn.Linear(hidden, cfg.intermediate_size)
        self.output = nn.Module()
        self.output.dense = nn.Linear(cfg.intermediate_size, hidden)
        self.output.LayerNorm = nn.LayerNorm(hidden, eps=cfg.layer_norm_eps)
        head_dim = hidden // heads
        self.attn = EncoderAttention(heads, head_dim, head_dim ** -0.5)
        if cfg.hidden_act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act: {cfg.hidden_act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[cfg.hidden_act]

    def forward(self, h: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        s = self.attention.self
        a = self.attn(s.query(h), s.key(h), s.value(h), meta)
        h = self.attention.output.LayerNorm(h + self.attention.output.dense(a))
        return self.output.LayerNorm(h + self.output.dense(self.act(self.intermediate.dense(h))))


class BertModel(LoadableModel):
    """Final hidden states of every token, [T, hidden]: the runner's pooler reads them (CLS, mean)."""
    uses_token_type_ids = True

    def __init__(self, hf_config: Any, tp: TPGroup = TPGroup()) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError("tensor_parallel_size: encoder models (BERT family) run on one rank")
        self.config = hf_config
        self.embeddings = BertEmbeddings(hf_config, self.position_offset(hf_config))
        self.encoder = nn.Module()
        self.encoder.layer = nn.ModuleList(BertLayer(hf_config) for _ in range(hf_config.num_hidden_layers))

    @staticmethod
    def position_offset(hf_config: Any) -> int:
        return 0

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embeddings(input_ids, positions, token_type_ids)
        for layer in self.encoder.layer:
            h = layer(h, meta)
        return h

    def attention_layers(self) -> list[nn.Module]:
        return []          # no paged attention: an encoder keeps no KV cache

    def stream_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Tensors the encoder has no parameter for are skipped, not refused: HF checkpoints carry heads it
        never runs (cls.predictions.*, a BertModel's pooler, position_ids)."""
        params = dict(self.named_parameters())
        loaded = set()
        for name, tensor in weights:
            local = self._local_name(name)
            if local in params:
                copy_weight(params[local].data, tensor, f"checkpoint tensor {name!r}")   # no silent broadcast
                loaded.add(local)
        return loaded

    def _local_name(self, name: str) -> str:
        for prefix in _PREFIXES:
            if name.startswith(prefix):
                return name[len(prefix):]
        return name

    def expected_weights(self) -> set[str]:
        return {n for n, _ in self.named_parameters()}


class XLMRobertaModel(BertModel):
    """RoBERTa numbers positions from padding_idx + 1 (HF: create_position_ids_from_input_ids)."""

    @staticmethod
    def position_offset(hf_config: Any) -> int:
        return int(hf_config.pad_token_id) + 1


class BertForSequenceClassification(BertModel):
    """A cross-encoder: BERT's pooler (dense + tanh over the CLS state) and a linear classifier."""

    def __init__(self, hf_config: Any, tp: TPGroup = TPGroup()) -> None:
        super().__init__(hf_config, tp)
        self.pooler = nn.Module()
        self.pooler.dense = nn.Linear(hf_config.hidden_size, hf_config.hidden_size)
        self.classifier = nn.Linear(hf_config.hidden_size, hf_config.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        """pooled [R, hidden] (the CLS states) -> logits [R, num_labels]."""
        return self.classifier(torch.tanh(self.pooler.dense(pooled)))

    def _local_name(self, name: str) -> str:
        return name if name.startswith("classifier.") else super()._local_name(name)


class XLMRobertaForSequenceClassification(XLMRobertaModel):
    """RoBERTa's classification head: dense + tanh + out_proj over the CLS state (no pooler)."""

    def __init__(self, hf_config: Any, tp: TPGroup = TPGroup()) -> None:
        super().__init__(hf_config, tp)
        self.classifier = nn.Module()
        self.classifier.dense = nn.Linear(hf_config.hidden_size, hf_config.hidden_size)
        self.classifier.out_proj = nn.Linear(hf_config.hidden_size, hf_config.num_labels)

    def classify(self, pooled: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(pooled)))

    def _local_name(self, name: str) -> str:
        return name if name.startswith("classifier.") else super()._local_name(name)


class RobertaModel(XLMRobertaModel):
    """RoBERTa's checkpoints share XLM-R's layout."""


class RobertaForSequenceClassification(XLMRobertaForSequenceClassification):
    pass
